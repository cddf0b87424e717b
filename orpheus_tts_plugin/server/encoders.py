"""The audio formats of `POST /v1/audio/speech`: each chunk encoded as it arrives, the encoder flushed at the end.

`mp3`, `opus` (in Ogg), `aac` (ADTS) and `flac` go through PyAV, which wraps ffmpeg's encoders (libmp3lame,
libopus, ffmpeg's own aac and flac) and muxers, the same library Pipecat and LiveKit decode audio with. `wav` is a
header for a stream of unknown length then the PCM; `pcm` is the PCM as the engine made it. Every format keeps the
engine's 24 kHz mono. An encoder's calls cost up to a millisecond a chunk (and tens of milliseconds to open), so
the route makes them in a worker thread, never on the server's loop (docs/serving.md has the figures).
"""

from __future__ import annotations

import io
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import missing_extra
from ..spec import SAMPLE_RATE


@dataclass(frozen=True)
class AudioFormat:
    """One `response_format`: the Content-Type OpenAI sends for it and how it is encoded (codec None: raw PCM)."""

    name: str
    content_type: str
    codec: str | None = None  # ffmpeg's encoder
    container: str | None = None  # ffmpeg's muxer
    sample_format: str = "s16"  # what the encoder takes
    bit_rate: int | None = None
    container_options: Mapping[str, str] = field(default_factory=dict)


FORMATS: dict[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("mp3", "audio/mpeg", "libmp3lame", "mp3", "s16p", 64_000),
        # An Ogg page per 20 ms packet: the muxer would otherwise hold a second of audio before writing a page.
        AudioFormat("opus", "audio/opus", "libopus", "ogg", "s16", 32_000, {"page_duration": "20000"}),
        AudioFormat("aac", "audio/aac", "aac", "adts", "fltp", 64_000),
        AudioFormat("flac", "audio/flac", "flac", "flac", "s16"),
        AudioFormat("wav", "audio/wav"),
        AudioFormat("pcm", "audio/pcm"),
    )
}
DEFAULT_FORMAT = "mp3"  # OpenAI's


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming encoders write)."""
    unknown = 0xFFFFFFFF
    rate = sample_rate
    return struct.pack(
        "<4sI8sIHHIIHH4sI", b"RIFF", unknown, b"WAVEfmt ", 16, 1, 1, rate, 2 * rate, 2, 16, b"data", unknown
    )


class _Sink(io.RawIOBase):
    """A write-only file the muxer writes into; `take()` empties it (a stream cannot seek back)."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._buffer += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buffer)
        self._buffer.clear()
        return out


class Encoder:
    """One response's encoder: `encode(pcm)` per chunk returns the bytes ready so far, `finish()` the rest.

    Made for a worker thread: its calls may come from any thread, one at a time (a lock orders a `close()` from
    the loop after an `encode` still running in a thread, when the client leaves mid-stream).
    """

    def __init__(self, fmt: AudioFormat, sample_rate: int = SAMPLE_RATE):
        self.format = fmt
        self._rate = sample_rate
        self._lock = threading.Lock()
        self._pts = 0
        self._closed = False
        self._sink: _Sink | None = None
        if fmt.codec is None:
            return
        try:
            import av
        except ImportError as exc:
            raise missing_extra("server", f"response_format {fmt.name!r}", exc) from None
        self._av = av
        self._sink = _Sink()
        self._container = av.open(self._sink, "w", format=fmt.container, options=dict(fmt.container_options))
        self._stream = self._container.add_stream(fmt.codec, rate=sample_rate, layout="mono")
        self._stream.format = fmt.sample_format
        if fmt.bit_rate is not None:
            self._stream.bit_rate = fmt.bit_rate
        self._container.start_encoding()  # opens the codec and writes the header now, not at the first chunk

    def header(self) -> bytes:
        """What goes before the first audio: the WAV header, else nothing (an encoder writes its own)."""
        return wav_header(self._rate) if self.format.name == "wav" else b""

    def encode(self, pcm: bytes) -> bytes:
        """The encoded bytes `pcm` (int16 LE mono) completes; b"" while the encoder fills a frame."""
        if self._sink is None:
            return pcm
        with self._lock:
            if self._closed or not pcm:
                return b""
            samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
            frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self._pts
            self._pts += samples.shape[1]
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
            return self._sink.take()

    def finish(self) -> bytes:
        """The encoder's last frames and the container's trailer; the encoder is closed after."""
        if self._sink is None:
            return b""
        with self._lock:
            if self._closed:
                return b""
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._closed = True
            self._container.close()
            return self._sink.take()

    def close(self) -> None:
        """Release the encoder without finishing the stream (the client left); waits for an `encode` under way."""
        if self._sink is None:
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                self._container.close()
