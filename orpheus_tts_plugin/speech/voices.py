"""Cloned voices: a reference recording and its transcript, encoded once into the reference turn of a prompt.

An engine's `add_voice(name, audio=..., transcript=...)` checks its input here (one-line TypeError/ValueError),
and the reference is encoded with the engine's SNAC encoder into frames, then into the reference part of every
prompt of that voice (`prompt.reference_prompt`), once: when the engine starts, or at once if it has.
"""

from __future__ import annotations

import math
import re
import threading
import wave
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..codec.codes import levels_to_frames
from ..spec import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME, ModelSpec
from .prompt import Tokenizer, reference_prompt

MAX_REFERENCE_S = 30.0  # longer references cost prefill and KV memory for little gain
MAX_TRANSCRIPT_CHARS = 2_000
PROMPT_ROOM = 512  # ids of max_seq_len a reference leaves for the text's prompt and its speech
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass
class ClonedVoice:
    """One added voice: its transcript, its audio until encoded, then its reference turn (prompt ids)."""

    name: str
    transcript: str
    samples: int
    audio: np.ndarray | None  # float32 at 24 kHz; dropped once encoded
    reference: tuple[int, ...] | None = None

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    def describe(self) -> dict[str, Any]:
        """What a listing shows of it."""
        out: dict[str, Any] = {"name": self.name, "kind": "cloned", "seconds": round(self.seconds, 3)}
        out["transcript"] = self.transcript
        out["prompt_ids"] = None if self.reference is None else len(self.reference)
        return out


def check_name(name: Any, spec: ModelSpec) -> str:
    if not isinstance(name, str):
        raise TypeError(f"voice name must be a str, got {type(name).__name__}")
    if not NAME.fullmatch(name):
        raise ValueError(f"voice name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting alphanumeric")
    if name in spec.voices:
        raise ValueError(f"voice name {name!r} is a stock voice of {spec.name!r}; choose another name")
    return name


def check_transcript(transcript: Any) -> str:
    if not isinstance(transcript, str):
        raise TypeError(f"transcript must be a str, got {type(transcript).__name__}")
    text = " ".join(transcript.split())
    if not text:
        raise ValueError("transcript is empty: give the words spoken in the reference audio")
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise ValueError(f"transcript of {len(text)} characters is over {MAX_TRANSCRIPT_CHARS}")
    return text


def reference_audio(audio: Any) -> np.ndarray:
    """float32 mono samples at 24 kHz from a WAV path or a 1-D float / int16 array at 24 kHz; one-line errors."""
    if isinstance(audio, (str, Path)):
        samples = read_wav(audio)
    elif isinstance(audio, np.ndarray):
        if audio.ndim != 1:
            raise ValueError(f"reference audio must be 1-D (mono, 24 kHz), got shape {audio.shape}")
        if audio.dtype == np.int16:
            samples = audio.astype(np.float32) / 32768.0
        elif np.issubdtype(audio.dtype, np.floating):
            samples = audio.astype(np.float32)
        else:
            raise TypeError(f"reference audio array must be float or int16, got {audio.dtype}")
    else:
        raise TypeError(f"reference audio must be a WAV path or a numpy array, got {type(audio).__name__}")
    if not np.isfinite(samples).all():
        raise ValueError("reference audio holds NaN or infinite samples")
    if len(samples) < SAMPLES_PER_FRAME:
        raise ValueError(f"reference audio of {len(samples)} samples is shorter than one frame ({SAMPLES_PER_FRAME})")
    if len(samples) > MAX_REFERENCE_S * SAMPLE_RATE:
        raise ValueError(f"reference audio of {len(samples) / SAMPLE_RATE:.1f} s is over {MAX_REFERENCE_S:g} s")
    return np.ascontiguousarray(samples)


def read_wav(path: str | Path | BinaryIO) -> np.ndarray:
    """A 16-bit PCM WAV at 24 kHz (a path or an open binary file) as float32 mono (channels averaged); ValueError in
    one line otherwise."""
    source = str(path) if isinstance(path, (str, Path)) else path
    if not isinstance(path, (str, Path)):
        path = "the WAV data"
    try:
        with wave.open(source, "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            data = w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as exc:
        raise ValueError(f"{path}: not a readable WAV file ({exc})") from None
    if width != 2:
        raise ValueError(f"{path}: {8 * width}-bit samples; reference audio must be 16-bit PCM")
    if rate != SAMPLE_RATE:
        raise ValueError(f"{path}: {rate} Hz; resample the reference to {SAMPLE_RATE} Hz first")
    pcm = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return pcm.reshape(-1, channels).mean(axis=1)


def check_fits(samples: int, transcript: str, max_seq_len: int) -> None:
    """ValueError unless the reference turn (at most this many ids) leaves PROMPT_ROOM ids of max_seq_len."""
    frames = math.ceil(samples / SAMPLES_PER_FRAME) + 1
    most = TOKENS_PER_FRAME * frames + len(transcript.encode()) + 8  # a token is at least one byte of text
    if most + PROMPT_ROOM > max_seq_len:
        raise ValueError(
            f"a reference of {samples / SAMPLE_RATE:.1f} s takes up to {most} prompt ids, too many for max_seq_len "
            f"{max_seq_len} (which needs {PROMPT_ROOM} more for the text): use a shorter reference"
        )


def encode_frames(snac: Any, audio: np.ndarray) -> np.ndarray:
    """(n, 7) SNAC frames of 24 kHz float audio, by SNAC's own encoder (it pads to whole frames)."""
    import torch

    param = next(snac.parameters())
    with torch.inference_mode():
        x = torch.from_numpy(audio).to(device=param.device, dtype=param.dtype)[None, None]
        codes = snac.encode(x)
    return levels_to_frames([c[0].cpu().numpy() for c in codes])


class Voices:
    """An engine's cloned voices by name, and the spec that lists them after the stock ones (any thread)."""

    def __init__(self, stock: ModelSpec):
        self.stock = stock
        self._voices: dict[str, ClonedVoice] = {}
        self._lock = threading.Lock()  # guards _voices; encoding holds _encoding
        self._encoding = threading.Lock()

    def check(self, name: Any, audio: Any, transcript: Any, max_seq_len: int) -> ClonedVoice:
        """A new voice from `add_voice`'s arguments; TypeError/ValueError in one line naming what is wrong."""
        name = check_name(name, self.stock)
        transcript = check_transcript(transcript)
        samples = reference_audio(audio)
        check_fits(len(samples), transcript, max_seq_len)
        with self._lock:
            if name in self._voices:
                raise ValueError(f"voice {name!r} is already added; remove_voice({name!r}) first to replace it")
        return ClonedVoice(name, transcript, len(samples), samples)

    def add(self, voice: ClonedVoice) -> ModelSpec:
        """Register `voice`; the spec that now lists it."""
        with self._lock:
            if voice.name in self._voices:
                raise ValueError(f"voice {voice.name!r} is already added; remove_voice({voice.name!r}) first")
            self._voices[voice.name] = voice
            return self._spec()

    def remove(self, name: str) -> tuple[ClonedVoice, ModelSpec]:
        """Unregister `name` (KeyError naming the added voices if it is not one); it and the spec without it."""
        with self._lock:
            voice = self._voices.pop(name, None)
            if voice is None:
                raise KeyError(f"no added voice {name!r}; added: {', '.join(self._voices) or 'none'}")
            return voice, self._spec()

    def _spec(self) -> ModelSpec:
        return replace(self.stock, voices=(*self.stock.voices, *self._voices))

    def get(self, name: str | None) -> ClonedVoice | None:
        with self._lock:
            return None if name is None else self._voices.get(name)

    def describe(self) -> list[dict[str, Any]]:
        """Every voice: the stock ones, then the added ones with their length and transcript."""
        with self._lock:
            added = [v.describe() for v in self._voices.values()]
        return [{"name": v, "kind": "stock"} for v in self.stock.voices] + added

    def encode(self, voice: ClonedVoice, tokenizer: Tokenizer, snac: Callable[[], Any]) -> tuple[int, ...]:
        """The voice's reference turn, encoded now if it was not yet (`snac()` gives the encoder)."""
        with self._encoding:
            if voice.reference is None:
                frames = encode_frames(snac(), voice.audio)
                voice.reference = reference_prompt(tokenizer, self.stock, voice.transcript, frames)
                voice.audio = None
            return voice.reference

    def encode_all(self, tokenizer: Tokenizer, snac: Callable[[], Any]) -> None:
        """Encode every voice added before the engine started."""
        with self._lock:
            pending = [v for v in self._voices.values() if v.reference is None]
        for voice in pending:
            self.encode(voice, tokenizer, snac)
