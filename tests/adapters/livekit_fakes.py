"""Scripted stand-ins for what an `AgentSession` listens to and speaks into, in the manner of livekit-agents' own
session tests (`tests/fake_*.py` upstream): VAD, STT and LLM follow a script of user turns, the microphone hears
silence and the speaker plays in (virtual) real time. Shared by the session tests of tests/adapters/.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from dataclasses import dataclass
from typing import Any

from livekit import rtc
from livekit.agents import Agent, LanguageCode, ModelSettings, llm, stt, vad
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    APIConnectOptions,
    NotGivenOr,
    TimedString,
)
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities


@dataclass(frozen=True)
class UserTurn:
    """The user speaks from `start` to `end` (seconds after the session's first audio frame)."""

    start: float
    end: float
    transcript: str


class Clock:
    """Seconds since the first input frame reached a fake stream."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))


class ScriptedVAD(vad.VAD):
    def __init__(self, turns: list[UserTurn]) -> None:
        super().__init__(capabilities=vad.VADCapabilities(update_interval=0.05))
        self.turns = turns

    def stream(self) -> vad.VADStream:
        return _ScriptedVADStream(self)


class _ScriptedVADStream(vad.VADStream):
    async def _main_task(self) -> None:
        assert isinstance(self._vad, ScriptedVAD)
        await self._input_ch.recv()
        clock = Clock()
        for turn in self._vad.turns:
            await clock.until(turn.start)
            self._send(vad.VADEventType.START_OF_SPEECH, speaking=True, speech=0.0)
            while clock.now() < turn.end:
                await asyncio.sleep(0.05)
                self._send(vad.VADEventType.INFERENCE_DONE, speaking=True, speech=clock.now() - turn.start)
            self._send(vad.VADEventType.END_OF_SPEECH, speaking=False, speech=turn.end - turn.start)
        async for _ in self._input_ch:
            pass

    def _send(self, type: vad.VADEventType, *, speaking: bool, speech: float) -> None:
        self._event_ch.send_nowait(
            vad.VADEvent(
                type=type,
                samples_index=0,
                timestamp=time.time(),
                speech_duration=speech,
                silence_duration=0.0,
                speaking=speaking,
                raw_accumulated_speech=speech if speaking else 0.0,
            )
        )


class ScriptedSTT(stt.STT):
    """Streaming STT: each turn's final transcript arrives `delay` seconds after the turn ends."""

    def __init__(self, turns: list[UserTurn], delay: float = 0.05) -> None:
        super().__init__(capabilities=stt.STTCapabilities(streaming=True, interim_results=False))
        self.turns, self.delay = turns, delay

    async def _recognize_impl(self, buffer: Any, *, language: Any = NOT_GIVEN, conn_options: Any) -> stt.SpeechEvent:
        raise NotImplementedError

    def stream(
        self, *, language: NotGivenOr[str] = NOT_GIVEN, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> stt.RecognizeStream:
        return _ScriptedRecognizeStream(stt=self, conn_options=conn_options)


class _ScriptedRecognizeStream(stt.RecognizeStream):
    async def _run(self) -> None:
        assert isinstance(self._stt, ScriptedSTT)
        await self._input_ch.recv()
        clock = Clock()
        for turn in self._stt.turns:
            await clock.until(turn.end + self._stt.delay)
            text = stt.SpeechData(text=turn.transcript, language=LanguageCode("en"))
            self._event_ch.send_nowait(stt.SpeechEvent(type=stt.SpeechEventType.FINAL_TRANSCRIPT, alternatives=[text]))
        async for _ in self._input_ch:
            pass


class ScriptedLLM(llm.LLM):
    """Answers each known user message with its set reply, streamed a few characters at a time."""

    def __init__(self, replies: dict[str, str]) -> None:
        super().__init__()
        self.replies = replies

    def chat(
        self, *, chat_ctx: llm.ChatContext, tools: Any = None, conn_options: Any = None, **_: Any
    ) -> llm.LLMStream:
        return _ScriptedLLMStream(self, chat_ctx=chat_ctx, tools=tools or [], conn_options=DEFAULT_API_CONNECT_OPTIONS)


class _ScriptedLLMStream(llm.LLMStream):
    async def _run(self) -> None:
        assert isinstance(self._llm, ScriptedLLM)
        reply = self._llm.replies.get(self.chat_ctx.items[-1].text_content or "", "")
        for i in range(0, len(reply), 8):
            delta = llm.ChoiceDelta(role="assistant", content=reply[i : i + 8])
            self._event_ch.send_nowait(llm.ChatChunk(id="scripted", delta=delta))
            await asyncio.sleep(0.002)


class SilentAudioInput(AudioInput):
    """A microphone that hears 20 ms of silence every 20 ms."""

    def __init__(self) -> None:
        super().__init__(label="silent-mic")

    async def __anext__(self) -> rtc.AudioFrame:
        await asyncio.sleep(0.02)
        return rtc.AudioFrame(data=b"\0\0" * 320, sample_rate=16000, num_channels=1, samples_per_channel=320)


class VirtualSpeaker(AudioOutput):
    """An audio sink that 'plays' what it captures in real time, and reports where an interruption cut it."""

    def __init__(self) -> None:
        super().__init__(label="virtual-speaker", capabilities=AudioOutputCapabilities(pause=False))
        self.captured = 0.0  # seconds of audio received, all segments
        self._segment = 0.0
        self._started_at: float | None = None
        self._finish: asyncio.TimerHandle | None = None

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        assert frame.sample_rate == 24000 and frame.num_channels == 1
        self.captured += frame.duration
        self._segment += frame.duration
        if self._started_at is None:
            self._started_at = time.time()
            self.on_playback_started(created_at=self._started_at)

    def _played(self) -> float:
        return 0.0 if self._started_at is None else min(time.time() - self._started_at, self._segment)

    def flush(self) -> None:
        super().flush()
        if self._segment:
            delay = self._segment - self._played()
            self._finish = asyncio.get_running_loop().call_later(delay, self._end, False)

    def clear_buffer(self) -> None:
        if self._segment:
            self._end(True)

    def _end(self, interrupted: bool) -> None:
        position = self._played()
        if self._finish is not None:
            self._finish.cancel()
        self._segment, self._started_at, self._finish = 0.0, None, None
        self.on_playback_finished(playback_position=position, interrupted=interrupted)


class TranscriptRecorder(Agent):
    """An agent that notes the timed words its transcript is made of (what the TTS aligned)."""

    def __init__(self) -> None:
        super().__init__(instructions="You tell stories.")
        self.timed: list[TimedString] = []

    async def transcription_node(
        self, text: AsyncIterable[str | TimedString], model_settings: ModelSettings
    ) -> AsyncGenerator[str | TimedString, None]:
        async for delta in text:
            if isinstance(delta, TimedString):
                self.timed.append(delta)
            yield delta


async def until_true(cond: Callable[[], bool]) -> None:
    """Return once `cond()` holds (poll every 10 ms: bound it with `asyncio.wait_for`)."""
    while not cond():
        await asyncio.sleep(0.01)
