"""Where a reply's time goes: the moments of each turn, seen on the server by a Pipecat observer.

`TurnMoments` (a Pipecat `BaseObserver`) notes when the frame that marks a stage first leaves the
processor that makes it, on `time.monotonic()`: one clock for every process of a machine, so the demo
lines the server's moments up with the simulated caller's own (waterfall.py). The stages, from the end
of the caller's speech:

- `vad_stop`: Silero says the speech stopped (VADUserStoppedSpeakingFrame out of the user aggregator);
- `transcript`: the final transcript (TranscriptionFrame out of the STT);
- `turn_end`: the turn strategy ends the user's turn (the LLMContextFrame the user aggregator sends on); speaking
  ahead (`--speak-ahead`, the default), at the VAD stop, with the reply's audio held (`speculation`, a
  ReplyHoldFrame) until the turn is confirmed (`turn_confirmed`, a ReplyReleaseFrame) or the caller goes on;
- `llm_first_token`: the first LLM text of the reply;
- `first_phrase_ready`: the TTS is handed the reply's first text to speak (its aggregator's first sentence, or
  first phrase: `first_phrase.py`), through TTSService's `on_tts_request` event (`TurnMoments.note`);
- `tts_first_audio`: the first audio out of OrpheusTTSService (the engine's first chunk);
- `transport_out`: the first audio the output transport has written to the call's WebSocket;
- `caller_first_audio`: the first agent audio at the caller (the caller's own measurement).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pipecat.frames.frames import (
    Frame,
    LLMContextFrame,
    LLMTextFrame,
    OutputAudioRawFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from orpheus_tts_plugin.pipecat import ReplyHoldFrame, ReplyReleaseFrame

BURST_GAP_S = 0.3  # a stage's frames closer together than this are one burst (the audio of one reply)


@dataclass(frozen=True)
class Marker:
    """A stage is reached when a frame of `frames` leaves `source` (downstream)."""

    stage: str
    source: FrameProcessor
    frames: tuple[type[Frame], ...]


def call_markers(
    user: FrameProcessor, stt: FrameProcessor, llm: FrameProcessor, tts: FrameProcessor, out: FrameProcessor
) -> list[Marker]:
    """The markers of one call's pipeline (transport in → STT → user aggregator → LLM → TTS → transport out)."""
    return [
        Marker("vad_stop", user, (VADUserStoppedSpeakingFrame,)),
        Marker("transcript", stt, (TranscriptionFrame,)),
        Marker("turn_end", user, (LLMContextFrame,)),
        Marker("speculation", user, (ReplyHoldFrame,)),
        Marker("turn_confirmed", user, (ReplyReleaseFrame,)),
        Marker("llm_first_token", llm, (LLMTextFrame,)),
        Marker("tts_first_audio", tts, (TTSAudioRawFrame,)),
        Marker("transport_out", out, (OutputAudioRawFrame,)),
    ]


class TurnMoments(BaseObserver):
    """Notes (time.monotonic(), stage) for the first frame of every burst of each marker."""

    def __init__(self, markers: list[Marker]):
        super().__init__()
        self._markers = markers
        self._last: dict[str, float] = {}
        self.moments: list[tuple[float, str]] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        if data.direction is not FrameDirection.DOWNSTREAM:
            return
        for marker in self._markers:
            if data.source is marker.source and isinstance(data.frame, marker.frames):
                self.note(marker.stage)

    def note(self, stage: str) -> None:
        """`stage` is reached now (the first of a burst is kept). Called on the pipeline's event loop."""
        now = time.monotonic()
        if now - self._last.get(stage, -math.inf) > BURST_GAP_S:
            self.moments.append((now, stage))
        self._last[stage] = now
