"""One source of truth for Orpheus token ids, voices and SNAC audio layout, per model family."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
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


ENGLISH = ModelSpec(
    name="orpheus-en",
    voices=("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"),
    default_voice="tara",
)

SPECS: dict[str, ModelSpec] = {ENGLISH.name: ENGLISH}


def spec_for(name: str | None) -> ModelSpec:
    """The spec of a model family by name (default: the English finetune)."""
    if name is None:
        return ENGLISH
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(SPECS)}") from None
