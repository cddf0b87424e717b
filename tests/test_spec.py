"""The model families' specs: their languages, voices and default voices."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin.spec import ENGLISH, SPECS, family_for_language, spec_for


def test_unknown_voice_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="tara.*leah.*zoe"):
        ENGLISH.check_voice("nobody")


# ---------------------------------------------------------------------------------------------- specs
FAMILIES = {  # family: (languages, voices, default voice), as Canopy published them (docs/voices.md)
    "orpheus-en": (("en",), ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"), "tara"),
    "orpheus-fr": (("fr",), ("pierre", "amelie", "marie"), "pierre"),
    "orpheus-de": (("de",), ("jana", "thomas", "max"), "jana"),
    "orpheus-ko": (("ko",), ("유나", "준서"), "유나"),
    "orpheus-hi": (("hi",), ("ऋतिका",), "ऋतिका"),
    "orpheus-zh": (("zh",), ("长乐", "白芷"), "长乐"),
    "orpheus-es_it": (("es", "it"), ("javi", "sergio", "maria", "pietro", "giulia", "carlo"), "javi"),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_has_its_languages_voices_and_the_english_token_layout(name: str) -> None:
    spec = spec_for(name)
    languages, voices, default = FAMILIES[name]
    assert (spec.languages, spec.voices, spec.default_voice) == (languages, voices, default)
    assert spec.check_voice(None) == default
    layout = ("bos", "end_of_text", "start_of_speech", "end_of_speech", "first_audio_token", "vocab_size")
    assert all(getattr(spec, f) == getattr(ENGLISH, f) for f in layout)
    for code in languages:
        assert family_for_language(code.upper() + "-XX") is spec


def test_a_language_picks_its_default_voice_or_keeps_one_that_speaks_it() -> None:
    es_it = spec_for("orpheus-es_it")
    assert es_it.voice_for_language("it") == "pietro" and es_it.voice_for_language("es-MX") == "javi"
    assert es_it.voice_for_language("it-IT", current="giulia") == "giulia"
    assert es_it.voice_for_language("it", current="maria") == "pietro"  # a Spanish voice does not speak Italian
    assert ENGLISH.voice_for_language("en-US", current="leo") == "leo"
    assert ENGLISH.voice_for_language("en") == "tara"
    with pytest.raises(ValueError, match="'orpheus-fr' does not speak 'de-DE'; it speaks: fr"):
        spec_for("orpheus-fr").voice_for_language("de-DE")
    with pytest.raises(ValueError, match="no model family speaks 'ja'"):
        family_for_language("ja")
    assert len(SPECS) == len(FAMILIES)
