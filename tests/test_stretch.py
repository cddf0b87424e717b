"""`stretch.py` keeps pitch: a sine stretched at 0.5, 1.5 and 3.0 keeps its frequency within 2 % at 1/speed of its
length, where a resample (what changes pitch with tempo) fails the same check."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.stretch import Stretch

HZ = 440.0  # a voice's range; 2 % of it is 8.8 Hz, many FFT bins of the second measured below
SECONDS = 3.0
CHUNK = 2048  # the engine's samples a frame: chunks as a stream brings them


def sine(seconds: float = SECONDS, hz: float = HZ) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (12_000 * np.sin(2 * np.pi * hz * t)).astype(np.int16)


def stretched(pcm: np.ndarray, speed: float) -> np.ndarray:
    """`pcm` through one Stretch, fed chunk by chunk as a stream is, then flushed."""
    stretch = Stretch(speed)
    out = b"".join(stretch.push(pcm[i : i + CHUNK].tobytes()) for i in range(0, pcm.size, CHUNK)) + stretch.flush()
    return np.frombuffer(out, dtype="<i2")


def resampled(pcm: np.ndarray, speed: float) -> np.ndarray:
    """A stand-in that changes tempo by resampling (played faster, as a tape): the length right, the pitch not."""
    n = round(pcm.size / speed)
    return np.interp(np.arange(n) * speed, np.arange(pcm.size), pcm.astype(np.float64)).astype(np.int16)


def frequency(pcm: np.ndarray) -> float:
    """The strongest frequency of the middle half of `pcm` (Hann window; bins of 1/length Hz, at least 2 Hz)."""
    middle = pcm[pcm.size // 4 : 3 * pcm.size // 4].astype(np.float64)
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(middle.size)))
    return float(np.argmax(spectrum)) * SAMPLE_RATE / middle.size


def keeps_pitch(stretch: Callable[[np.ndarray, float], np.ndarray], speed: float) -> bool:
    """`stretch` at `speed` makes 1/speed of the sine's length (within two 20 ms frames) at its frequency within 2 %."""
    sent = sine()
    got = stretch(sent, speed)
    assert abs(got.size - sent.size / speed) <= 2 * 480, (got.size, sent.size / speed)
    return abs(frequency(got) - HZ) <= 0.02 * HZ


@pytest.mark.parametrize("speed", [0.5, 1.5, 3.0])
def test_the_stretch_keeps_a_sines_frequency_at_each_speed_and_a_resample_does_not(speed: float) -> None:
    assert abs(frequency(sine()) - HZ) <= 0.005 * HZ  # the measure itself
    assert keeps_pitch(stretched, speed)
    assert not keeps_pitch(resampled, speed)  # what the check would say of a stretch that changed pitch
