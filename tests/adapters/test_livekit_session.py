"""An AgentSession (real livekit-agents voice pipeline) speaking through the Orpheus TTS, then interrupted.

STT, LLM, VAD and audio I/O are the scripted fakes of livekit_fakes.py: the user speaks at set times, the LLM
answers a set text, the audio sink plays in (virtual) real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from livekit.agents import Agent, AgentSession, AgentStateChangedEvent, llm, utils
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.agents.voice.io import PlaybackFinishedEvent
from livekit.agents.voice.transcription.synchronizer import TranscriptSynchronizer

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.words import DEFAULT_WEIGHTS, total_weight, units
from tests.adapters.livekit_fakes import (
    ScriptedLLM,
    ScriptedSTT,
    ScriptedVAD,
    SilentAudioInput,
    TranscriptRecorder,
    UserTurn,
    VirtualSpeaker,
    until_true,
)

STORY = " ".join(f"This is sentence number {i} of a story that goes on for quite a while." for i in range(12))


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
        await asyncio.wait_for(until_true(lambda: bool(finished)), timeout=20)
        await asyncio.wait_for(until_true(lambda: slow_engine.stats()["active_streams"] == 0), timeout=1)
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
        await asyncio.wait_for(until_true(lambda: bool(finished)), timeout=20)
        await asyncio.wait_for(until_true(lambda: _reply(agent) is not None), timeout=5)
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
