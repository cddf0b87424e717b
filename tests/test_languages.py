"""Languages (issue 22, part 3): the multilingual model families' specs, sentence splitting in each script, and a
non-English family spoken through the engine, a server in a thread and `orpheus-tts serve` with a RemoteEngine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, RemoteEngine
from orpheus_tts_plugin.server.serve import serving_in_thread
from orpheus_tts_plugin.spec import ENGLISH, SPECS, family_for_language, spec_for
from orpheus_tts_plugin.text import split_sentences
from orpheus_tts_plugin.tools.loopback import free_port
from tests.servers import serve_args, serve_process

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


# ---------------------------------------------------------------------------------------------- splitting
# Real sentences in each script; max_chars small enough that the sentence bounds show, pieces merged up to it.
SPLITS = {
    "fr": (
        "Bonjour, je m'appelle Marie. Comment allez-vous aujourd'hui ? Il fait très beau à Paris !",
        40,
        ["Bonjour, je m'appelle Marie.", "Comment allez-vous aujourd'hui ?", "Il fait très beau à Paris !"],
    ),
    "de": (  # "z. B." and "3,5" stay as written and do not end a sentence
        "Das Wetter ist heute z. B. sehr schön. Wir gehen 3,5 km spazieren. Kommst du mit?",
        40,
        ["Das Wetter ist heute z. B. sehr schön.", "Wir gehen 3,5 km spazieren.", "Kommst du mit?"],
    ),
    "es": (
        "¿Cómo estás? ¡Muy bien, gracias! Nos vemos mañana a las 3.30 en la plaza.",
        45,
        ["¿Cómo estás? ¡Muy bien, gracias!", "Nos vemos mañana a las 3.30 en la plaza."],
    ),
    "it": (
        "Ciao, come stai? Sto bene, grazie. Andiamo al mare domani mattina con gli amici.",
        35,
        ["Ciao, come stai? Sto bene, grazie.", "Andiamo al mare domani mattina con", "gli amici."],
    ),
    "zh": (  # no spaces after 。！？ and none put back between Chinese sentences
        "今天天气很好。我们去公园散步吧！你想一起来吗？「好啊。」他说。",
        20,
        ["今天天气很好。我们去公园散步吧！", "你想一起来吗？「好啊。」他说。"],
    ),
    "ko": (
        "안녕하세요. 오늘 날씨가 정말 좋네요. 공원에 산책하러 갈까요? 네, 좋아요!",
        20,
        ["안녕하세요.", "오늘 날씨가 정말 좋네요.", "공원에 산책하러 갈까요?", "네, 좋아요!"],
    ),
    "hi": (
        "मैं आज बाज़ार गया। वहाँ बहुत भीड़ थी॥ क्या तुम कल मेरे साथ चलोगे?",
        30,
        ["मैं आज बाज़ार गया।", "वहाँ बहुत भीड़ थी॥", "क्या तुम कल मेरे साथ चलोगे?"],
    ),
    "ar": ("هل أنت بخير؟ نعم، أنا بخير شكرا لك.", 24, ["هل أنت بخير؟", "نعم، أنا بخير شكرا لك."]),
}


@pytest.mark.parametrize("language", sorted(SPLITS))
def test_sentences_split_at_each_scripts_own_marks(language: str) -> None:
    text, max_chars, pieces = SPLITS[language]
    assert split_sentences(text, max_chars) == pieces


def test_a_long_chinese_sentence_splits_at_full_width_clause_marks_then_between_characters() -> None:
    text = "这是一个很长的句子，里面有很多逗号，还有一些顿号、分号；以及冒号：最后才结束。"
    assert split_sentences(text, 20) == [
        "这是一个很长的句子，里面有很多逗号，",
        "还有一些顿号、分号；以及冒号：",
        "最后才结束。",
    ]
    unbroken = "我们明天早上八点在学校门口见面" * 5 + "<laugh>" + "然后一起去图书馆看书" * 3
    pieces = split_sentences(unbroken, 24)
    assert "".join(pieces) == unbroken and all(len(p) <= 24 for p in pieces)
    assert any(p.startswith("<laugh>") or p.endswith("<laugh>") or "<laugh>" in p for p in pieces)  # never cut


def test_a_long_hindi_word_run_is_never_cut_before_a_combining_mark() -> None:
    text = "क्या" * 30  # each क्या is consonant + virama + consonant + vowel sign, no spaces
    pieces = split_sentences(text, 21)
    assert "".join(pieces) == text
    assert all(p[0] not in "\u094d\u093e" for p in pieces)  # no piece starts with a virama or a vowel sign


# ---------------------------------------------------------------------------------------------- engine, server
def family(config: EngineConfig, name: str) -> EngineConfig:
    return replace(config, model_family=name)


async def test_an_engine_of_a_chinese_family_speaks_its_voices_and_splits_chinese(
    synthetic_config: EngineConfig,
) -> None:
    engine = OrpheusEngine(family(synthetic_config, "orpheus-zh"))
    try:
        text = SPLITS["zh"][0]
        stream = engine.synthesize(text, voice="白芷", max_tokens=70)
        chunks = [c async for c in stream]
        assert list(stream.sentences) == split_sentences(text, engine.config.sentence_max_chars) == [text]
        assert chunks and engine.check_options(None)[0] == "长乐"
        with pytest.raises(ValueError, match="valid voices: 长乐, 白芷"):
            engine.synthesize(text, voice="tara")
    finally:
        await engine.aclose()


async def test_a_server_of_a_korean_family_says_its_voices_and_a_remote_engine_checks_them(
    synthetic_config: EngineConfig,
) -> None:
    engine = OrpheusEngine(family(synthetic_config, "orpheus-ko"))
    with serving_in_thread(engine) as srv:
        deadline = time.monotonic() + 120
        while not engine.ready:
            assert time.monotonic() < deadline, engine.health()
            await asyncio.sleep(0.01)
        remote = RemoteEngine(srv.url, model_family="orpheus-ko")
        await remote.start()
        try:
            assert remote.spec.voices == ("유나", "준서") and remote.spec.languages == ("ko",)
            text = SPLITS["ko"][0]
            stream = remote.synthesize(text, voice="준서", max_tokens=70)
            assert [c async for c in stream] and list(stream.sentences) == [text]
            with pytest.raises(ValueError, match="valid voices: 유나, 준서"):
                remote.synthesize(text, voice="tara")
        finally:
            await remote.aclose()


async def test_orpheus_tts_serve_with_a_model_family_serves_its_voices(test_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = serve_args(test_model_dir / "snac", port, 0.0, "--model-family", "orpheus-hi")
    with serve_process(args, tmp_path / "serve.log"):
        remote = RemoteEngine(f"ws://127.0.0.1:{port}", model_family="orpheus-hi")
        await remote.start()
        try:
            assert remote.spec.voices == ("ऋतिका",) and remote.check_options(None)[0] == "ऋतिका"
            text = SPLITS["hi"][0]
            stream = remote.synthesize(text, max_tokens=70)
            assert [c async for c in stream] and list(stream.sentences) == [text]
            with pytest.raises(ValueError, match="valid voices: ऋतिका"):
                remote.synthesize(text, voice="leo")
        finally:
            await remote.aclose()
