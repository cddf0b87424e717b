"""int16 mono 24 kHz WAV files, and `orpheus-tts compare` (max abs difference of two of them)."""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import numpy as np

from ..spec import SAMPLE_RATE


def write_wav(path: str | Path, pcm: bytes | np.ndarray) -> None:
    """Write int16 mono 24 kHz PCM as a WAV file."""
    data = pcm.astype("<i2").tobytes() if isinstance(pcm, np.ndarray) else pcm
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(data)


def read_wav(path: str | Path) -> np.ndarray:
    """Read an int16 mono WAV (as written by write_wav)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def compare_main(args: argparse.Namespace) -> int:
    """`orpheus-tts compare A B`: exit 0 if the max abs difference is within the tolerance."""
    a, b = read_wav(args.a), read_wav(args.b)
    if a.size != b.size:
        print(f"length differs: {a.size} vs {b.size} samples")
        return 1
    diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if a.size else 0
    ok = diff <= args.tolerance
    print(
        f"{a.size} samples each; max abs difference {diff} int16 steps (tolerance {args.tolerance}): "
        f"{'OK' if ok else 'DIFFERENT'}"
    )
    return 0 if ok else 1
