"""Offline speech recognition for the phone agent: pocketsphinx, decoding while the caller speaks.

pocketsphinx holds the GIL while it decodes (a quarter to a third of real time on one core), so decoding runs in
worker processes shared by every call; the event loop that carries the calls' audio never waits on it.
Each utterance is decoded as it is spoken: from the VAD's start (with the second of audio before it, as
the VAD starts late) its audio goes to one worker in 0.1 s pieces, so at the VAD's stop only the last
piece and the end of the utterance are left (a few ms) and the transcript comes right after the stop,
not a whole-segment decode (0.4-1 s on an idle core, seconds with four callers at once) later.
The workers run at a lower CPU priority (nice): on a machine with few cores a decode then waits for the
agent's audio path (the TTS threads, the event loop that writes to the callers) instead of starving it.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
from collections.abc import AsyncGenerator, Awaitable, Coroutine
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    StartFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import STTService
from pipecat.transcriptions.language import Language
from pipecat.utils.time import time_now_iso8601

from orpheus_tts_plugin.runtime.affinity import pin_process

SAMPLE_RATE = 16_000  # the acoustic model's rate; the pipeline's input rate must match
BYTES_PER_S = 2 * SAMPLE_RATE  # 16-bit mono
FEED_S = 0.1  # audio goes to the worker in pieces this long: 10 messages a second per speaking caller
PRE_ROLL_S = 1.0  # audio kept from before the VAD's start (it starts after vad_start_secs of speech)
TRAILING_SILENCE_S = 0.3  # appended at the end, so the decoder hears the last word end
# How long a transcript may take after the end of speech (the end of a decode that fell behind on a busy CPU).
# The turn-end strategy waits this long for a late transcript instead of ending the turn without it.
TRANSCRIPT_P99_S = 3.0

# Narrower search beams than pocketsphinx's defaults: about 3x faster, nearly the same transcripts on phone
# audio. No second (flat-lexicon) pass: it re-decodes the whole utterance at its end, which is what streaming
# takes off the turn's critical path (190-320 ms per line here, for a transcript of the same words).
# The cepstral mean a decoder starts each call's live normalisation from: pocketsphinx's default is wideband
# speech's; a phone line's audio (8 kHz, upsampled) has nothing above 4 kHz, and from the default the first
# utterances decode to noise words ("are you are ya ya ya"). This is the whole-utterance mean of the demo's
# two caller lines (espeak-ng through 8 kHz mu-law): a narrowband prior, which live normalisation then adapts.
PHONE_CMN_INIT = "51.19,24.19,-34.73,43.47,-30.64,-1.41,3.71,-35.99,12.21,-15.04,8.56,5.62,-18.39"
DECODER_OPTIONS = dict(beam=1e-35, pbeam=1e-35, wbeam=1e-25, maxhmmpf=5000, fwdflat=False, cmninit=PHONE_CMN_INIT)

WORKER_NICE = 10  # added to the workers' niceness: below the agent's audio path, above nothing else

# Worker process state: each open utterance's decoder, and decoders free for the next utterance.
_decoders: dict[int, Any] = {}
_idle: list[Any] = []


def _new_decoder() -> Any:
    from pocketsphinx import Decoder

    return Decoder(samprate=SAMPLE_RATE, loglevel="FATAL", **DECODER_OPTIONS)


def _load_decoders(count: int, cpus: frozenset[int] | None) -> None:
    """Worker initializer: lower the priority, move to `cpus` (if given), load `count` decoders (more are made
    if more callers speak)."""
    if hasattr(os, "nice"):
        os.nice(WORKER_NICE)
    if cpus is not None:
        pin_process(cpus)
    _idle.extend(_new_decoder() for _ in range(count))


def _ready() -> int:
    """Worker: the number of free decoders (to wait for the initializer)."""
    return len(_idle)


def _begin(key: int, pcm: bytes) -> None:
    """Worker: open utterance `key` on a free decoder and decode its first audio."""
    decoder = _idle.pop() if _idle else _new_decoder()
    decoder.start_utt()
    _decoders[key] = decoder
    if pcm:
        decoder.process_raw(pcm)


def _feed(key: int, pcm: bytes) -> None:
    """Worker: decode the next piece of utterance `key`."""
    _decoders[key].process_raw(pcm)


def _finish(key: int, pcm: bytes) -> str:
    """Worker: decode the last piece of utterance `key`, end it; its best hypothesis ("" if none)."""
    decoder = _decoders.pop(key)
    try:
        if pcm:
            decoder.process_raw(pcm)
        decoder.end_utt()
        hyp = decoder.hyp()
        return hyp.hypstr.strip() if hyp is not None else ""
    finally:
        _idle.append(decoder)


def _drop(key: int) -> None:
    """Worker: end utterance `key` unheard (the call ended while the caller spoke)."""
    decoder = _decoders.pop(key, None)
    if decoder is not None:
        decoder.end_utt()
        _idle.append(decoder)


class Utterance:
    """One utterance being decoded in one worker; its pieces reach the worker in the order they are fed.

    Event loop only, but for `_error`: a piece's failure (the worker died, say), set once by the pool's thread
    and raised by `finish`.
    """

    def __init__(self, pool: ProcessPoolExecutor, key: int, pcm: bytes, on_close: Any):
        self._pool, self._key, self._on_close = pool, key, on_close
        self._error: BaseException | None = None
        self._closed = False
        self._submit(_begin, key, pcm)

    def _submit(self, fn: Any, *args: Any) -> None:
        try:
            self._pool.submit(fn, *args).add_done_callback(self._note_error)
        except RuntimeError as e:  # the pool is shut down or broken
            self._error = self._error or e

    def _note_error(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._error = self._error or future.exception()

    def feed(self, pcm: bytes) -> None:
        """Send the next piece of audio (16 kHz int16) without waiting for it to be decoded."""
        if not self._closed:
            self._submit(_feed, self._key, pcm)

    def finish(self, pcm: bytes = b"") -> Coroutine[Any, Any, str]:
        """Send the last piece and end the utterance: awaits its transcript."""
        self._close()
        try:
            future: Awaitable[str] | None = asyncio.wrap_future(self._pool.submit(_finish, self._key, pcm))
        except RuntimeError as e:  # the pool is shut down or broken
            self._error, future = self._error or e, None
        return self._checked(future)

    async def _checked(self, transcript: Awaitable[str] | None) -> str:
        text = "" if transcript is None else await transcript
        if self._error is not None:
            raise RuntimeError(f"pocketsphinx lost part of the utterance: {self._error!r}") from self._error
        return text

    def drop(self) -> None:
        """End the utterance without a transcript."""
        if not self._closed:
            self._close()
            self._submit(_drop, self._key)

    def _close(self) -> None:
        if self._closed:
            raise RuntimeError("the utterance has already ended")
        self._closed = True
        self._on_close()


class PocketsphinxRecognizer:
    """pocketsphinx decoders in worker processes, shared by every call in the server.

    Each utterance stays on one worker (its decoder's state lives there); a new one goes to the worker with
    the fewest open utterances.
    """

    def __init__(self, workers: int = 2, decoders_per_worker: int = 2, cpus: frozenset[int] | None = None):
        """`cpus`: where the workers run (None: where this process does), e.g. all CPUs when the agent is pinned."""
        context = multiprocessing.get_context("spawn")
        options = (decoders_per_worker, cpus)
        self._pools = [
            ProcessPoolExecutor(1, mp_context=context, initializer=_load_decoders, initargs=options)
            for _ in range(workers)
        ]
        self._open = [0] * workers  # event loop only: open utterances per worker
        self._keys = itertools.count()

    async def start(self) -> None:
        """Load the decoders in every worker now rather than on the first caller's first words."""
        await asyncio.gather(*(asyncio.wrap_future(pool.submit(_ready)) for pool in self._pools))

    def begin(self, pcm: bytes = b"") -> Utterance:
        """Open an utterance starting with `pcm` (16 kHz int16) on the least busy worker."""
        return self._begin_on(min(range(len(self._pools)), key=self._open.__getitem__), pcm)

    def _begin_on(self, worker: int, pcm: bytes) -> Utterance:
        self._open[worker] += 1

        def closed() -> None:
            self._open[worker] -= 1

        return Utterance(self._pools[worker], next(self._keys), pcm, closed)

    async def transcribe(self, pcm: bytes) -> str:
        """One whole utterance → its transcript."""
        return await self.begin(pcm).finish()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(cancel_futures=True)


class PocketsphinxSTTService(STTService):
    """Streaming STT on a shared PocketsphinxRecognizer: one transcript per VAD segment, right after its stop."""

    def __init__(self, recognizer: PocketsphinxRecognizer, p99_s: float = TRANSCRIPT_P99_S, **kwargs: Any):
        super().__init__(
            sample_rate=SAMPLE_RATE,
            ttfs_p99_latency=p99_s,
            settings=STTSettings(model="pocketsphinx-en-us", language=Language.EN_US),
            **kwargs,
        )
        self._recognizer = recognizer
        # Event loop only: the last second of audio while the caller is silent, the open utterance and its
        # audio not yet sent, ended segments awaiting their transcript (in order; None: stop), and counts of
        # segments the VAD has ended and transcripts pushed.
        self._recent = bytearray()
        self._utterance: Utterance | None = None
        self._unsent = bytearray()
        self._endings: asyncio.Queue[Coroutine[Any, Any, str] | None] = asyncio.Queue()
        self._endings_task: asyncio.Task | None = None
        self._segments = 0
        self._transcribed = 0

    def can_generate_metrics(self) -> bool:
        return True

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._endings_task = self.create_task(self._push_transcripts())

    async def stop(self, frame: EndFrame) -> None:
        """Transcribe what the caller said before the call ended, then stop."""
        self._drop_utterance()
        if self._endings_task is not None:
            await self._endings.put(None)
            await self._endings_task
            self._endings_task = None
        await super().stop(frame)

    async def cancel(self, frame: CancelFrame) -> None:
        self._drop_utterance()
        if self._endings_task is not None:
            await self.cancel_task(self._endings_task)
            self._endings_task = None
        while not self._endings.empty():  # transcripts no one will hear
            if (ending := self._endings.get_nowait()) is not None:
                ending.close()
        await super().cancel(frame)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """Open an utterance at the VAD's start (with the audio just before it), end it at the VAD's stop."""
        if isinstance(frame, VADUserStartedSpeakingFrame):
            self._drop_utterance()
            self._utterance = self._recognizer.begin(bytes(self._recent))
            self._recent.clear()
        elif isinstance(frame, VADUserStoppedSpeakingFrame) and self._utterance is not None:
            tail = bytes(self._unsent) + bytes(int(TRAILING_SILENCE_S * BYTES_PER_S))
            self._unsent.clear()
            self._segments += 1
            await self._endings.put(self._utterance.finish(tail))
            self._utterance = None
        await super().process_frame(frame, direction)

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame | None, None]:
        """Each audio frame: to the open utterance in FEED_S pieces, else into the pre-roll."""
        if self._utterance is None:
            self._recent += audio
            del self._recent[: max(0, len(self._recent) - int(PRE_ROLL_S * BYTES_PER_S))]
        else:
            self._unsent += audio
            if len(self._unsent) >= FEED_S * BYTES_PER_S:
                self._utterance.feed(bytes(self._unsent))
                self._unsent.clear()
        yield None

    async def _push_transcripts(self) -> None:
        """Await each ended segment's transcript in order and push it.

        A transcript is final only if the caller has not spoken since its segment ended: when a decode falls
        behind the caller's pause (a comma, on a busy CPU), a final transcript arriving while the next segment
        is spoken would tell the turn-stop strategy "nothing more is coming", and the turn would end at the
        next VAD stop without the last segment's words, which would start a second turn.
        """
        while (ending := await self._endings.get()) is not None:
            await self.start_processing_metrics()
            try:
                text = await ending
            except Exception as e:  # noqa: BLE001 - reported; the call then apologises and ends (failures.py)
                await self.push_error(f"{self}: transcription failed: {e}", exception=e)
                text = ""
            finally:
                await self.stop_processing_metrics()
                self._transcribed += 1
            if text:
                # One caller a call: no user id (STTService keeps its own private).
                frame = TranscriptionFrame(text, "", time_now_iso8601(), Language.EN_US)
                frame.finalized = self._utterance is None and self._transcribed == self._segments
                await self.push_frame(frame)

    def _drop_utterance(self) -> None:
        if self._utterance is not None:
            self._utterance.drop()
            self._utterance = None
        self._unsent.clear()
