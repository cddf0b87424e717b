"""One source of truth for Orpheus token ids, voices and SNAC audio layout, per model family."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 2_048
TOKENS_PER_FRAME = 7
CODEBOOK_SIZE = 4_096
# SNAC level of each of the 7 positions in a frame: 0 coarse, 1 middle, 2 fine.
FRAME_LEVELS = (0, 1, 2, 2, 1, 2, 2)
LEVEL_POSITIONS = ((0,), (1, 4), (2, 3, 5, 6))


@dataclass(frozen=True)
class ModelSpec:
    """Token ids and voices of one Orpheus model family."""

    name: str
    vocab_size: int = 156_940
    bos: int = 128_000
    end_of_text: int = 128_009
    start_of_speech: int = 128_257
    end_of_speech: int = 128_258
    start_of_human: int = 128_259
    end_of_human: int = 128_260
    start_of_ai: int = 128_261
    end_of_ai: int = 128_262
    pad: int = 128_263
    first_audio_token: int = 128_266
    custom_token_base: int = 128_256
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    # The language the family speaks (ISO 639-1 base code); None: not known (a family the server named but this
    # package has no spec for), and then any language is accepted and picks no voice.
    language: str | None = None
    # Each language the family speaks with its own voices, the first its default: (code, voices). Empty: `language`
    # with every voice. The Spanish/Italian release speaks two languages, each with three voices.
    language_voices: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def audio_token_end(self) -> int:
        """One past the last valid audio id (all 7 positions)."""
        return self.first_audio_token + TOKENS_PER_FRAME * CODEBOOK_SIZE

    @cached_property
    def audio_ids(self) -> tuple[int, ...]:
        """Every audio id (all 7 frame positions, in id order), then end of speech: what audio-only sampling allows."""
        return (*range(self.first_audio_token, self.audio_token_end), self.end_of_speech)

    def stop_ids(self, extra: Iterable[int] = ()) -> tuple[int, ...]:
        """End of speech first, then `extra`, without repeats: the ids that end a generation."""
        return tuple(dict.fromkeys((self.end_of_speech, *extra)))

    def audio_token(self, position: int, code: int) -> int:
        """Id of `code` at frame position `position`."""
        return self.first_audio_token + position * CODEBOOK_SIZE + code

    def prompt_suffix(self) -> tuple[int, ...]:
        """Ids that follow the tokenised text: end of text, end of human, start of AI, start of speech."""
        return (self.end_of_text, self.end_of_human, self.start_of_ai, self.start_of_speech)

    def allowed_ids(self, position: int) -> np.ndarray:
        """Ids valid as the next token at frame position `position` (end of speech only between frames)."""
        lo = self.audio_token(position, 0)
        ids = np.arange(lo, lo + CODEBOOK_SIZE, dtype=np.int64)
        if position == 0:
            ids = np.concatenate([ids, np.array([self.end_of_speech], dtype=np.int64)])
        return ids

    def check_voice(self, voice: str | None) -> str | None:
        """Return the voice to use; raise ValueError naming the valid voices if unknown."""
        if voice is None or voice == "":
            return self.default_voice
        if not isinstance(voice, str):
            raise TypeError(f"voice must be a str, got {type(voice).__name__} {voice!r}")
        if self.voices and voice not in self.voices:
            raise ValueError(
                f"unknown voice {voice!r} for model family {self.name!r}; valid voices: {', '.join(self.voices)}"
            )
        return voice

    @property
    def languages(self) -> tuple[str, ...]:
        """The languages the family speaks (base codes); empty if not known."""
        if self.language_voices:
            return tuple(code for code, _ in self.language_voices)
        return (self.language,) if self.language else ()

    def check_language(self, language: str) -> str:
        """The base code of `language` ("fr-FR" -> "fr"); ValueError in one line if the family does not speak it."""
        code = base_language(language)
        if self.languages and code not in self.languages:
            raise ValueError(
                f"model family {self.name!r} does not speak {str(language)!r}; it speaks: {', '.join(self.languages)}"
            )
        return code

    def voice_for_language(self, language: str, current: str | None = None) -> str | None:
        """The voice to speak `language` in: `current` if it is one of that language's voices, else its default.

        ValueError if the family does not speak `language`; a family whose languages are not known keeps `current`.
        """
        code = self.check_language(language)
        voices = dict(self.language_voices).get(code)
        if voices is None:  # the family's one language (or languages not known): all its voices
            return (
                current if current is not None and (not self.voices or current in self.voices) else self.default_voice
            )
        return current if current in voices else voices[0]


def base_language(language: str) -> str:
    """The base code of a language tag, as `ModelSpec.languages` holds it: "fr-FR", "FR", "fr_fr" -> "fr"."""
    if not isinstance(language, str):
        raise TypeError(f"language must be a str, got {type(language).__name__} {language!r}")
    code = language.strip().lower().replace("_", "-").split("-")[0]
    if not code:
        raise ValueError(f"language must be a language code such as 'en' or 'fr-FR', got {language!r}")
    return code


ENGLISH = ModelSpec(
    name="orpheus-en",
    voices=("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"),
    default_voice="tara",
    language="en",
)

# Canopy Labs' multilingual research release (April 2025, "Orpheus Multilingual Research Release" collection on
# Hugging Face): one finetune per language, canopylabs/3b-{fr,de,ko,hi,zh,es_it}-ft-research_release, each with a
# pretrained sibling (…-pretrain-research_release, no named voices, not listed here). Their voices are those
# Canopy's Orpheus-TTS README points to (canopylabs.ai/releases/orpheus_can_speak_any_language#info), as every
# integration of these models lists them. Canopy names no default voice: the first voice listed is used, as
# "tara" is first in the English list. Token ids: Canopy's README states "a standardised prompt format across
# languages" and no model card read here names a difference, so every family uses the English layout (same
# Llama-3 tokenizer and custom tokens); not checked against the checkpoints' tokenizer files.
FRENCH = ModelSpec(name="orpheus-fr", voices=("pierre", "amelie", "marie"), default_voice="pierre", language="fr")
GERMAN = ModelSpec(name="orpheus-de", voices=("jana", "thomas", "max"), default_voice="jana", language="de")
KOREAN = ModelSpec(name="orpheus-ko", voices=("유나", "준서"), default_voice="유나", language="ko")
HINDI = ModelSpec(name="orpheus-hi", voices=("ऋतिका",), default_voice="ऋतिका", language="hi")
MANDARIN = ModelSpec(name="orpheus-zh", voices=("长乐", "白芷"), default_voice="长乐", language="zh")
SPANISH_ITALIAN = ModelSpec(
    name="orpheus-es_it",
    voices=("javi", "sergio", "maria", "pietro", "giulia", "carlo"),
    default_voice="javi",
    language="es",
    language_voices=(("es", ("javi", "sergio", "maria")), ("it", ("pietro", "giulia", "carlo"))),
)

SPECS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (ENGLISH, FRENCH, GERMAN, KOREAN, HINDI, MANDARIN, SPANISH_ITALIAN)
}
# Hugging Face checkpoint of each family's finetune (the English one: Canopy's current name for it).
CHECKPOINTS: dict[str, str] = {
    ENGLISH.name: "canopylabs/orpheus-3b-0.1-ft",
    FRENCH.name: "canopylabs/3b-fr-ft-research_release",
    GERMAN.name: "canopylabs/3b-de-ft-research_release",
    KOREAN.name: "canopylabs/3b-ko-ft-research_release",
    HINDI.name: "canopylabs/3b-hi-ft-research_release",
    MANDARIN.name: "canopylabs/3b-zh-ft-research_release",
    SPANISH_ITALIAN.name: "canopylabs/3b-es_it-ft-research_release",
}


def family_for_language(language: str) -> ModelSpec:
    """The spec of the family that speaks `language` ("de-AT" -> orpheus-de); ValueError naming those known."""
    code = base_language(language)
    for spec in SPECS.values():
        if code in spec.languages:
            return spec
    known = ", ".join(code for spec in SPECS.values() for code in spec.languages)
    raise ValueError(f"no model family speaks {str(language)!r}; languages known: {known}")


def with_voices(spec: ModelSpec, names: Iterable[str]) -> ModelSpec:
    """`spec` with `names` added to its voices (those it has already are kept once, in place)."""
    return replace(spec, voices=tuple(dict.fromkeys((*spec.voices, *names))))


def spec_for(name: str | None) -> ModelSpec:
    """The spec of a model family by name (default: the English finetune)."""
    if name is None:
        return ENGLISH
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(SPECS)}") from None
