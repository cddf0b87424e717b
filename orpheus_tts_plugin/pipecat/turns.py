"""Pipecat turn-taking that speaks while the caller's turn is still being confirmed.

`SpeakAheadUserTurnStopStrategy` ends the caller's turn as soon as the VAD has stopped and the transcript is in,
an ordinary turn end: the LLM answers it and `OrpheusTTSService` speaks the reply at once, but holds its audio
(`ReplyHoldFrame`). The wrapped `confirm` strategy (the speech timeout by default, or smart-turn) goes on judging
the pause; when it would have ended the turn, the audio is let out (`ReplyReleaseFrame`). If the caller speaks
again first, a new turn starts and Pipecat's own barge-in cancels the reply: nothing of it was heard, so no word
of it enters the context, which then holds the caller's turn as two user messages.

Why not Pipecat's speculation (`LLMContextFrame.speculation`, pipecat/turns/speculation_gate.py): every
`LLMService` holds a speculative reply's text in its `SpeculationGate` until the turn ends, so the TTS could not
start before it; and a non-speculative inference inside a turn still open is not cancelled when the caller goes
on (no new turn starts, so no interruption). An ordinary turn end, with the audio held, is the public route.
"""

from __future__ import annotations

from typing import Any

from ..errors import missing_extra

try:
    from pipecat.frames.frames import Frame, SystemFrame
    from pipecat.processors.frame_processor import FrameProcessorSetup
    from pipecat.turns.types import ProcessFrameResult
    from pipecat.turns.user_stop import BaseUserTurnStopStrategy, SpeechTimeoutUserTurnStopStrategy
    from pipecat.turns.user_stop.base_user_turn_stop_strategy import UserTurnStoppedParams
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("pipecat", "the Pipecat adapter", exc) from exc


class ReplyHoldFrame(SystemFrame):
    """The turn ended before it was confirmed: the TTS holds the audio of the reply that follows."""


class ReplyReleaseFrame(SystemFrame):
    """The turn is confirmed: the TTS lets the held reply's audio out at once."""


class SpeakAheadUserTurnStopStrategy(BaseUserTurnStopStrategy):
    """Ends the turn at the VAD stop (transcript in hand) with the reply's audio held, and releases it when
    `confirm` would have ended the turn (default: Pipecat's speech timeout, 0.6 s)."""

    def __init__(self, confirm: BaseUserTurnStopStrategy | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._early = SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=0.0)
        self._confirm = confirm or SpeechTimeoutUserTurnStopStrategy()
        self._held = False  # a reply's audio is held: the next verdict of `confirm` releases it
        self._confirmed = False  # `confirm` ended the turn before the early judge did: nothing to hold

    @property
    def confirm(self) -> BaseUserTurnStopStrategy:
        """The strategy whose verdict releases a held reply."""
        return self._confirm

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        for inner in (self._early, self._confirm):
            await inner.setup(setup)
            inner.add_event_handler("on_push_frame", self._forward_push)
            inner.add_event_handler("on_broadcast_frame", self._forward_broadcast)
        self._early.add_event_handler("on_user_turn_stopped", self._on_early_stop)
        self._confirm.add_event_handler("on_user_turn_stopped", self._on_confirmed)

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._early.cleanup()
        await self._confirm.cleanup()

    async def handle_user_turn_started(self) -> None:
        """A new turn: whatever was held is being interrupted by Pipecat; both judges start afresh."""
        self._held = self._confirmed = False
        await self._early.handle_user_turn_started()
        await self._confirm.handle_user_turn_started()

    async def handle_user_turn_stopped(self) -> None:
        """The turn ended (here, early): the early judge resets; `confirm` keeps judging the pause."""
        await self._early.handle_user_turn_stopped()

    async def process_frame(self, frame: Frame) -> ProcessFrameResult:
        if not isinstance(frame, (ReplyHoldFrame, ReplyReleaseFrame)):
            await self._early.process_frame(frame)
            await self._confirm.process_frame(frame)
        return ProcessFrameResult.CONTINUE

    async def _on_early_stop(self, _strategy: BaseUserTurnStopStrategy, params: UserTurnStoppedParams) -> None:
        self._held = not self._confirmed
        if self._held:
            await self.broadcast_frame(ReplyHoldFrame)
        await self.trigger_user_turn_stopped(enable_user_speaking_frames=params.enable_user_speaking_frames)

    async def _on_confirmed(self, _strategy: BaseUserTurnStopStrategy, _params: UserTurnStoppedParams) -> None:
        await self._confirm.handle_user_turn_stopped()
        if self._held:
            self._held = False
            await self.broadcast_frame(ReplyReleaseFrame)
        else:
            self._confirmed = True

    async def _forward_push(self, _strategy: BaseUserTurnStopStrategy, frame: Frame, *args: Any) -> None:
        await self.push_frame(frame, *args)

    async def _forward_broadcast(self, _strategy: BaseUserTurnStopStrategy, frame_cls: type[Frame], **kw: Any) -> None:
        await self.broadcast_frame(frame_cls, **kw)
