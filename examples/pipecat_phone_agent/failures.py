"""A stage that fails mid-call ends the call cleanly: the caller hears a short apology, then the line closes.

Without this a failed LLM or STT leaves the caller in silence until they hang up. The first failure of the
call's STT or LLM is logged in one line; the TTS speaks `APOLOGY` with the caller muted (talking over it cannot
cut it off); once the caller has heard it an `EndFrame` ends the pipeline, which closes the media stream:
Twilio has no TwiML left after `<Connect><Stream>`, so it hangs up. A TTS written off ends the call the same
way without the apology (nothing could speak it); a full TTS engine is no failure (it comes back once the
engine has room).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from loguru import logger
from pipecat.frames.frames import (
    AggregatedTextFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.turns.user_mute.base_user_mute_strategy import BaseUserMuteStrategy
from pipecat.utils.errors import ErrorCategory

APOLOGY = "Sorry, something went wrong on our side. Please call again later."
APOLOGY_TEXT_TYPE = "apology"  # the TTS's text frames of the apology carry it: its context is told apart by it
APOLOGY_TIMEOUT_S = 30.0  # a TTS that has not finished the apology by then is not waited for
PLAYOUT_MARGIN_S = 0.3  # the network and the caller's jitter buffer, after the audio's own length


class MuteWhileEnding(BaseUserMuteStrategy):
    """Mutes the caller once the call is ending, so that their speech cannot interrupt the apology."""

    def __init__(self) -> None:
        super().__init__()
        self.ending = False

    async def process_frame(self, frame: Frame) -> bool:
        """Muted from the failure on."""
        await super().process_frame(frame)
        return self.ending


class _Apology:
    """The apology's audio as it leaves the TTS: when it began and how long it is, hence when the caller has
    heard it. The transport sends audio up to twice as fast as it plays (FastAPIWebsocketOutputTransport), so
    the line closing when the last chunk is sent would cut off the caller's buffer."""

    def __init__(self) -> None:
        self.context_id: str | None = None
        self.began: float | None = None
        self.seconds = 0.0
        self.spoken = asyncio.Event()

    def note(self, frame: Frame) -> None:
        """Take in a frame the TTS pushed: the apology's context, its audio, its end."""
        if isinstance(frame, AggregatedTextFrame) and frame.text_type == APOLOGY_TEXT_TYPE:
            self.context_id = frame.context_id
        elif isinstance(frame, TTSAudioRawFrame) and frame.context_id == self.context_id:
            self.began = time.monotonic() if self.began is None else self.began
            self.seconds += len(frame.audio) / (2 * frame.num_channels * frame.sample_rate)
        elif isinstance(frame, TTSStoppedFrame) and frame.context_id == self.context_id:
            self.spoken.set()

    def left_to_play_s(self) -> float:
        """Seconds until the caller has heard all of it (0 if it had no audio)."""
        if self.began is None:
            return 0.0
        return max(0.0, self.began + self.seconds + PLAYOUT_MARGIN_S - time.monotonic())


class EndOnStageFailure(BaseObserver):
    """Watches a call's pipeline errors and ends the call at the first failure of one of its stages."""

    def __init__(
        self,
        call_sid: str,
        *,
        stt: FrameProcessor,
        llm: FrameProcessor,
        tts: FrameProcessor,
        mute: MuteWhileEnding,
    ):
        super().__init__()
        self._call_sid = call_sid
        self._stt, self._llm, self._tts = stt, llm, tts
        self._mute = mute
        self._apology: _Apology | None = None

    def attach(self, worker: PipelineWorker) -> None:
        """Handle the errors that reach `worker` (`on_pipeline_error`: every ErrorFrame that travels upstream)
        and watch what its TTS speaks."""
        worker.add_event_handler("on_pipeline_error", self._on_error)
        worker.add_observer(self)

    def failed_stage(self, error: ErrorFrame) -> str | None:
        """Which stage `error` says has failed ("STT", "LLM", "TTS"), or None if the call can go on."""
        if error.processor is self._stt:
            return "STT"
        if error.processor is self._llm:
            return "LLM"
        if error.processor is self._tts and not self._tts.is_usable and error.category is not ErrorCategory.RATE_LIMIT:
            return "TTS"
        return None

    async def on_push_frame(self, data: FramePushed) -> None:
        """Follow the apology out of the TTS."""
        if self._apology is not None and data.source is self._tts and data.direction is FrameDirection.DOWNSTREAM:
            self._apology.note(data.frame)

    async def _on_error(self, worker: PipelineWorker, error: ErrorFrame) -> None:
        stage = self.failed_stage(error)
        if stage is None or self._mute.ending:
            return
        self._mute.ending = True
        speak = stage != "TTS"
        logger.error(
            f"call {self._call_sid}: the {stage} failed ({error.error}); "
            f"{'apologising and ' if speak else ''}hanging up"
        )
        if speak:
            self._apology = apology = _Apology()
            await worker.queue_frame(TTSSpeakFrame(APOLOGY, text_type=APOLOGY_TEXT_TYPE))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(apology.spoken.wait(), APOLOGY_TIMEOUT_S)
            await asyncio.sleep(apology.left_to_play_s())
        await worker.queue_frame(EndFrame(reason=f"the {stage} failed"))
