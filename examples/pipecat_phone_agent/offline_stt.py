"""Offline speech recognition for the phone agent: pocketsphinx and the US English model its wheel ships.

pocketsphinx holds the GIL while it decodes (about half real time on one core), so decoding runs in
worker processes shared by every call; the event loop that carries the calls' audio never waits on it.
The workers run at a lower CPU priority (nice): on a machine with few cores a decode then waits for the
agent's audio path (the TTS threads, the event loop that writes to the callers) instead of starving it;
a transcript may come a little later, a gap in the agent's speech does not.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import AsyncGenerator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pipecat.frames.frames import Frame, TranscriptionFrame, VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import SegmentedSTTService, STTService
from pipecat.transcriptions.language import Language
from pipecat.utils.time import time_now_iso8601

SAMPLE_RATE = 16_000  # the acoustic model's rate; the pipeline's input rate must match
# How long a transcript may take after the end of speech (decode time plus queueing behind other calls on a
# busy CPU). The turn-end strategy waits this long for a late transcript instead of ending the turn without it.
TRANSCRIPT_P99_S = 3.0

# Narrower search beams than pocketsphinx's defaults: about 3x faster, nearly the same transcripts on phone audio.
DECODER_OPTIONS = dict(beam=1e-35, pbeam=1e-35, wbeam=1e-25, maxhmmpf=5000)

WORKER_NICE = 10  # added to the workers' niceness: below the agent's audio path, above nothing else

_decoder: Any = None  # one per worker process


def _load_decoder() -> None:
    global _decoder
    from pocketsphinx import Decoder

    if hasattr(os, "nice"):
        os.nice(WORKER_NICE)
    _decoder = Decoder(samprate=SAMPLE_RATE, loglevel="FATAL", **DECODER_OPTIONS)


def _decode(pcm: bytes) -> str:
    """Worker process: one utterance of 16 kHz int16 PCM → its best hypothesis ("" if none)."""
    _decoder.start_utt()
    _decoder.process_raw(pcm, full_utt=True)
    _decoder.end_utt()
    hyp = _decoder.hyp()
    return hyp.hypstr.strip() if hyp is not None else ""


class PocketsphinxRecognizer:
    """A pool of pocketsphinx decoders in worker processes, shared by every call in the server."""

    def __init__(self, workers: int = 1):
        self._workers = workers
        self._pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_load_decoder
        )

    async def start(self) -> None:
        """Load the model in every worker now rather than on the first caller's first words."""
        await asyncio.gather(*(self.transcribe(bytes(SAMPLE_RATE // 5)) for _ in range(self._workers)))

    async def transcribe(self, pcm: bytes) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._pool, _decode, pcm)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


class PocketsphinxSTTService(SegmentedSTTService):
    """Segmented STT (one transcript per VAD segment) on a shared PocketsphinxRecognizer."""

    def __init__(self, recognizer: PocketsphinxRecognizer, **kwargs: Any):
        super().__init__(
            sample_rate=SAMPLE_RATE,
            ttfs_p99_latency=TRANSCRIPT_P99_S,
            settings=STTSettings(model="pocketsphinx-en-us", language=Language.EN_US),
            **kwargs,
        )
        self._recognizer = recognizer
        # Event loop only: segments the VAD has ended, segments taken for transcription, caller speaking now.
        self._segments = 0
        self._transcribed = 0
        self._speaking = False

    @property
    def wants_wav_segments(self) -> bool:
        """pocketsphinx reads raw 16-bit PCM."""
        return False

    def can_generate_metrics(self) -> bool:
        return True

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """Count the caller's speech segments (one per VAD stop) and note whether the caller speaks now."""
        if isinstance(frame, VADUserStartedSpeakingFrame):
            self._speaking = True
        elif isinstance(frame, VADUserStoppedSpeakingFrame):
            self._speaking = False
            self._segments += 1
        await super().process_frame(frame, direction)

    async def push_frame(self, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM) -> None:
        """Push a frame; a transcript is final only if the caller has not spoken since its segment ended.

        Pipecat's `SegmentedSTTService` marks every segment's transcript finalized. When a segment's decode
        outlasts the caller's pause (a comma, on a busy CPU), that transcript arrives while the next segment
        is spoken, and the turn-stop strategy takes it as "nothing more is coming": the turn then ends at the
        next VAD stop without the last segment's words, which start a second turn. Such a transcript goes
        out unfinalized here, so the turn ends on its last segment's transcript, however slow the CPU.
        """
        if isinstance(frame, TranscriptionFrame) and (self._speaking or self._transcribed < self._segments):
            await STTService.push_frame(self, frame, direction)  # past SegmentedSTTService's finalized=True
            return
        await super().push_frame(frame, direction)

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame, None]:
        """Transcribe one speech segment in a worker process (a failure is reported by the base class)."""
        self._transcribed += 1
        await self.start_processing_metrics()
        try:
            text = await self._recognizer.transcribe(audio)
        finally:
            await self.stop_processing_metrics()
        if text:
            yield TranscriptionFrame(text, self._user_id, time_now_iso8601(), Language.EN_US)
