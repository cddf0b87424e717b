"""G.711 μ-law, the 8 kHz telephone encoding that Twilio Media Streams carry, in numpy (no audioop)."""

from __future__ import annotations

import numpy as np

RATE = 8_000
PACKET_BYTES = 160  # 20 ms at 8 kHz, one byte per sample: what Twilio sends per media message
SILENCE = 0xFF  # μ-law code of a zero sample

_BIAS = 0x84
_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])


def encode(pcm: np.ndarray) -> bytes:
    """int16 samples → μ-law bytes (bit-exact with the ITU reference on 14-bit magnitudes)."""
    x = pcm.astype(np.int32) >> 2
    negative = x < 0
    magnitude = np.minimum(np.abs(x), 8159) + (_BIAS >> 2)
    segment = np.searchsorted(_SEGMENT_ENDS, magnitude)
    code = np.where(segment < 8, (segment << 4) | ((magnitude >> (segment + 1)) & 0x0F), 0x7F)
    return (code ^ np.where(negative, 0x7F, 0xFF)).astype(np.uint8).tobytes()


def decode(data: bytes) -> np.ndarray:
    """μ-law bytes → int16 samples."""
    u = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    magnitude = (((u & 0x0F) << 3) + _BIAS << exponent) - _BIAS
    return np.where(u & 0x80, -magnitude, magnitude).astype(np.int16)


def silence(seconds: float) -> bytes:
    """μ-law silence of the given length."""
    return bytes([SILENCE]) * round(seconds * RATE)


def voiced_until(data: bytes, floor: int = 328) -> float:
    """Seconds from the start of `data` to the end of its last sample above `floor` (-40 dBFS): where speech ends."""
    loud = np.flatnonzero(np.abs(decode(data).astype(np.int32)) > floor)
    return (loud[-1] + 1) / RATE if loud.size else 0.0
