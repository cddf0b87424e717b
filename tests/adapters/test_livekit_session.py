"""An AgentSession (real livekit-agents voice pipeline) speaking through the Orpheus TTS, then interrupted.

STT, LLM, VAD and audio I/O are scripted fakes in the manner of livekit-agents' own session tests: the
user speaks at set times, the LLM answers a set text, the audio sink plays in (virtual) real time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from livekit import rtc
from livekit.agents import (
    Agent,
    AgentSession,
    AgentStateChangedEvent,
    LanguageCode,
    ModelSettings,
    llm,
    stt,
    utils,
    vad,
)
from livekit.agents.types import (
    DEFAULT_API_CONNECT_OPTIONS,
    NOT_GIVEN,
    USERDATA_TIMED_TRANSCRIPT,
    APIConnectOptions,
    NotGivenOr,
    TimedString,
)
from livekit.agents.voice.io import AudioInput, AudioOutput, AudioOutputCapabilities, PlaybackFinishedEvent
from livekit.agents.voice.transcription.synchronizer import TranscriptSynchronizer

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.words import DEFAULT_WEIGHTS, total_weight, units

STORY = " ".join(f"This is sentence number {i} of a story that goes on for quite a while." for i in range(12))


@dataclass(frozen=True)
class UserTurn:
    """The user speaks from `start` to `end` (seconds after the session's first audio frame)."""

    start: float
    end: float
    transcript: str


class _Clock:
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
        clock = _Clock()
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
        clock = _Clock()
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


@pytest.fixture(scope="module", params=[0.0, 150.0], ids=["fast-generation", "slow-generation"])
def slow_engine(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> Iterator[OrpheusEngine]:
    """Tokens unpaced (the reply is generated ahead of playback, as on a GPU) or at 150/s a stream (about 1.8x
    real time: its first sentence alone, some 800 tokens, is still being generated when the user cuts in at 2.5 s).
    """
    engine = OrpheusEngine(replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param)))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


TURNS = [UserTurn(0.2, 0.7, "Tell me a story."), UserTurn(2.5, 3.2, "Stop!")]


def story_session(
    engine: OrpheusEngine, turns: list[UserTurn] = TURNS, tts_options: dict[str, Any] | None = None, **options: Any
) -> AgentSession:
    """A session on scripted VAD, STT and LLM (`turns`: asked for a story, then cut off) speaking through Orpheus."""
    return AgentSession(
        vad=ScriptedVAD(turns),
        stt=ScriptedSTT(turns),
        llm=ScriptedLLM({"Tell me a story.": STORY}),
        tts=orpheus.TTS(engine=engine, voice="leo", **(tts_options or {})),
        turn_handling={
            "turn_detection": "vad",
            "endpointing": {"min_delay": 0.2, "max_delay": 2.0},
            "interruption": {"mode": "vad", "min_duration": 0.2, "resume_false_interruption": False},
        },
        aec_warmup_duration=None,
        user_away_timeout=None,
        **options,
    )


async def test_agent_session_speaks_through_orpheus_and_an_interruption_stops_it(slow_engine: OrpheusEngine) -> None:
    session = story_session(slow_engine)
    speaker = VirtualSpeaker()
    session.input.audio = SilentAudioInput()
    session.output.audio = speaker
    states: list[AgentStateChangedEvent] = []
    finished: list[PlaybackFinishedEvent] = []
    session.on("agent_state_changed", states.append)
    speaker.on("playback_finished", finished.append)
    started = slow_engine.stats().get("streams_started", 0)
    agent = Agent(instructions="You tell stories.")

    await session.start(agent)
    try:
        await asyncio.wait_for(_until_true(lambda: bool(finished)), timeout=20)
        await asyncio.wait_for(_until_true(lambda: slow_engine.stats()["active_streams"] == 0), timeout=1)
    finally:
        await session.aclose()

    (playback,) = finished
    assert playback.interrupted
    assert 0.5 < playback.playback_position < speaker.captured  # it spoke, and was cut before the end
    assert [s.new_state for s in states][:4] == ["listening", "thinking", "speaking", "listening"]
    stats = slow_engine.stats()
    if slow_engine.config.synthetic.tokens_per_second:  # generation slower than the interruption: it was stopped
        assert stats["streams_cancelled"] >= 1  # the engine request in flight was aborted, not run to its end
        assert stats["streams_started"] - started < STORY.count(".")  # later sentences were never requested
    reply = [item for item in agent.chat_ctx.items if item.type == "message" and item.role == "assistant"]
    assert reply and reply[0].interrupted


async def _until_true(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_both_streams_carry_every_word_once_in_order_timed_from_the_segments_start_without_tags(
    slow_engine: OrpheusEngine,
) -> None:
    text = "Hello <laugh> there. This is the second sentence, with a comma."
    tts = orpheus.TTS(engine=slow_engine)
    assert tts.capabilities.aligned_transcript
    chunked = [ev async for ev in tts.synthesize(text)]
    stream = tts.stream()
    stream.push_text(text)
    stream.end_input()
    streamed = [ev async for ev in stream]
    await stream.aclose()
    timed = []
    for events in (chunked, streamed):
        words = [w for ev in events for w in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
        assert "".join(words) == text.replace("<laugh> ", "") + " "
        audio_s = sum(ev.frame.duration for ev in events)
        starts = [w.start_time for w in words]
        assert starts == sorted(starts) and all(w.start_time <= w.end_time <= audio_s + 1e-6 for w in words)
        timed.append(words)
    # stream() sends each sentence as its own request: the second's words come after the first's whole audio.
    first_s = sum([c.num_samples async for c in slow_engine.synthesize("Hello <laugh> there.")]) / SAMPLE_RATE
    assert timed[1][2].start_time >= first_s - 1e-6


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


async def test_with_the_tts_aligned_transcript_an_interrupted_reply_keeps_the_words_played(
    slow_engine: OrpheusEngine,
) -> None:
    # The speaking-rate prior set to this voice's rate, as for a real voice measured beforehand: the test
    # model's noise has no words, so the estimate's own error would otherwise dominate.
    first = STORY[: STORY.index(".") + 1]
    seconds = sum([c.num_samples async for c in slow_engine.synthesize(first, voice="leo")]) / SAMPLE_RATE
    weights = replace(DEFAULT_WEIGHTS, seconds_per_unit=seconds / total_weight(units(first)))
    turns = [TURNS[0], UserTurn(5.0, 5.7, "Stop!")]  # cut off some 4 s into the reply's first sentence
    session = story_session(slow_engine, turns, {"word_weights": weights}, use_tts_aligned_transcript=True)
    assert session.tts is not None and session.tts.capabilities.aligned_transcript
    speaker = VirtualSpeaker()
    # What LiveKit's room output does: the transcript is released as the audio plays, and the chat context
    # of an interrupted reply gets what was released by the interruption.
    synchronizer = TranscriptSynchronizer(next_in_chain_audio=speaker, next_in_chain_text=None)
    session.input.audio = SilentAudioInput()
    session.output.audio = synchronizer.audio_output
    session.output.transcription = synchronizer.text_output
    finished: list[PlaybackFinishedEvent] = []
    speaker.on("playback_finished", finished.append)
    agent = TranscriptRecorder()

    await session.start(agent)
    try:
        await asyncio.wait_for(_until_true(lambda: bool(finished)), timeout=20)
        await asyncio.wait_for(_until_true(lambda: _reply(agent) is not None), timeout=5)
    finally:
        await session.aclose()
        await synchronizer.aclose()

    (playback,) = finished
    reply = _reply(agent)
    assert playback.interrupted and reply is not None and reply.interrupted
    said = (reply.text_content or "").split()
    assert said == STORY.split()[: len(said)]  # the reply's own words, in order
    assert all(utils.is_given(w.start_time) and utils.is_given(w.end_time) for w in agent.timed)
    starts = [w.start_time for w in agent.timed]
    assert starts == sorted(starts) and len(agent.timed) > len(said)  # timed ahead of playback, in order
    played = [w for w in agent.timed if w.start_time <= playback.playback_position]
    assert len(played) >= 3 and abs(len(said) - len(played)) <= 1, (said, playback.playback_position)


def _reply(agent: Agent) -> llm.ChatMessage | None:
    """The agent's first reply in its chat context, if there is one yet."""
    return next((i for i in agent.chat_ctx.items if i.type == "message" and i.role == "assistant"), None)
