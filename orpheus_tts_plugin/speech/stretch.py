"""`speed`: a stream's audio stretched in time with its pitch kept, chunk by chunk, by ffmpeg's `atempo` (PyAV).

Applied by the engine to a `synthesize` stream after decoding, so that every way in (the adapters in process,
`RemoteEngine` and both server routes through the server's engine) gets the same audio. `atempo` is a WSOLA
time-stretch: each output chunk is the input so far at 1/speed of its length, less the window it holds back
(tens of milliseconds); a sentence's last chunk flushes the window, so each sentence's audio is whole and its
`utterance_end` and the stream's `final` chunk stay where they were. One instance takes factors in [0.5, 2];
speeds outside that chain two.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from fractions import Fraction

import numpy as np

from ..spec import SAMPLE_RATE
from ..types import AudioChunk

FACTOR_RANGE = (0.5, 2.0)  # what one `atempo` instance takes in every ffmpeg release
FEED_SAMPLES = 480  # 20 ms: how much audio `atempo` takes at a time (its output lags by up to two such frames)


def factors(speed: float) -> list[float]:
    """`speed` as a product of `atempo` factors, each in FACTOR_RANGE (one for speeds inside it)."""
    lo, hi = FACTOR_RANGE
    count = 1
    while not lo <= speed ** (1 / count) <= hi:
        count += 1
    return [speed ** (1 / count)] * count


class Stretch:
    """One sentence's time-stretch: `push(pcm)` returns the stretched audio ready so far, `flush()` the rest.

    Not thread-safe: one caller at a time.
    """

    def __init__(self, speed: float, sample_rate: int = SAMPLE_RATE):
        try:
            import av
        except ImportError as exc:
            raise ImportError(
                f"speed {speed} needs PyAV: pip install av (the pipecat, livekit and server extras bring it) ({exc})"
            ) from None
        self._av = av
        self._rate = sample_rate
        self._pts = 0
        self._held = bytearray()  # input short of a whole feed frame
        graph = av.filter.Graph()
        nodes = [
            graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono", time_base=Fraction(1, sample_rate))
        ]
        nodes += [graph.add("atempo", f"{f:.6f}") for f in factors(speed)]
        nodes.append(graph.add("abuffersink"))
        for a, b in zip(nodes, nodes[1:], strict=False):
            a.link_to(b)
        graph.configure()
        self._graph = graph

    def push(self, pcm: bytes) -> bytes:
        """The stretched audio that `pcm` (int16 LE mono) makes ready.

        Fed in whole frames of FEED_SAMPLES, the rest kept for the next push: `atempo` gives out an output frame
        only once it is full and sizes it from the input frame (a whole chunk in would come out with the next one),
        and equal frames make the output independent of how the audio was cut into chunks."""
        self._held += pcm
        whole = len(self._held) // (2 * FEED_SAMPLES) * 2 * FEED_SAMPLES
        out = bytearray()
        for i in range(0, whole, 2 * FEED_SAMPLES):
            out += self._feed(self._held[i : i + 2 * FEED_SAMPLES])
        del self._held[:whole]
        return bytes(out)

    def flush(self) -> bytes:
        """The audio still held; the stretch is done after."""
        out = self._feed(bytes(self._held)) if self._held else b""
        self._held.clear()
        self._graph.push(None)
        return out + self._pull()

    def _feed(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        self._pts += samples.shape[1]
        self._graph.push(frame)
        return self._pull()

    def _pull(self) -> bytes:
        out = bytearray()
        while True:
            try:
                frame = self._graph.pull()
            except (self._av.error.BlockingIOError, self._av.error.EOFError):
                return bytes(out)
            out += frame.to_ndarray().astype("<i2", copy=False).tobytes()


async def stretched(chunks: AsyncGenerator[AudioChunk, None], speed: float) -> AsyncGenerator[AudioChunk, None]:
    """`chunks` at `speed`, pitch kept: the same sentences, `utterance_end` and `final` flags, `start_sample` counted
    in the stretched audio. Closing it closes `chunks` at once (a barge-in aborts the engine as before). Runs on
    the caller's loop: about 0.1 ms a chunk (docs/serving.md)."""
    stretch: Stretch | None = None
    start = 0
    try:
        async for chunk in chunks:
            if stretch is None:
                stretch = Stretch(speed, chunk.sample_rate)
            pcm = stretch.push(chunk.pcm)
            if chunk.utterance_end or chunk.final:
                pcm += stretch.flush()
                stretch = None
            elif not pcm:
                continue  # the window is still filling: nothing to give yet
            yield AudioChunk(pcm, start, chunk.final, chunk.sample_rate, chunk.utterance, chunk.utterance_end)
            start += len(pcm) // 2
    finally:
        await chunks.aclose()
