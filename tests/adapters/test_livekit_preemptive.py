"""LiveKit's preemptive generation on Orpheus: an `AgentSession` that starts a reply before the turn is confirmed.

On every final transcript LiveKit starts a reply to it before the end of the caller's turn is confirmed
(`AgentActivity.on_preemptive_generation`, livekit/agents/voice/agent_activity.py); with
`turn_handling={"preemptive_generation": {"preemptive_tts": True}}` the reply's synthesis starts too
(`_pipeline_reply_task_impl`). A changed transcript (the caller went on) cancels it and starts another, up to
`max_retries` a turn. These tests hold the TTS to that: a discarded synthesis never reaches the speaker and leaves no
engine stream open; the confirmed one plays whole, with its aligned transcript. The session classes are LiveKit's
own; VAD, STT, LLM and audio I/O are the fakes of livekit_fakes.py.

Run as a script, it prints what the discarded syntheses cost the engine (docs/livekit.md, "Preemptive generation").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, Iterator
from dataclasses import dataclass, field, replace

import pytest
from livekit import rtc
from livekit.agents import Agent, AgentSession, ConversationItemAddedEvent, ModelSettings, llm
from livekit.agents.voice.io import PlaybackFinishedEvent
from livekit.agents.voice.transcription.synchronizer import TranscriptSynchronizer

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
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

PACES = {"fast-generation": 0.0, "paced-generation": 300.0}
# Longer than the caller's pauses below, so that each pause is a speculation and not the end of the turn.
ENDPOINTING_S = 0.8
ASKED = "Tell me a story."
REPLY = "Once upon a time. The end."
# The reply to a transcript the caller goes on from: long enough that, paced, it is still being made when discarded.
WRONG = " ".join(f"This is sentence number {i} of an answer to a question nobody asked." for i in range(12))


@pytest.fixture(scope="module", params=list(PACES.values()), ids=list(PACES))
def engine(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> Iterator[OrpheusEngine]:
    """Synthetic tokens unpaced (generation ahead of playback, as on a GPU: a discarded reply may be made whole before
    the discard) or at 300/s a stream (3.6x real time: it is still being made); utterances a third of the usual length.
    """
    synthetic = SyntheticConfig(tokens_per_second=request.param, frames_per_prompt_token=0.5)
    engine = OrpheusEngine(replace(synthetic_config, synthetic=synthetic))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@dataclass
class Synthesis:
    """One run of the agent's TTS node (one reply's speech): its span, the audio it yielded, whether it ran out."""

    began: float  # time.monotonic()
    ended: float | None = None
    audio_s: float = 0.0
    finished: bool = False  # all its text spoken; False: cancelled by LiveKit


class SynthesisRecorder(TranscriptRecorder):
    """An agent that notes every synthesis LiveKit runs through its (default) TTS node, and its aligned words."""

    def __init__(self) -> None:
        super().__init__()
        self.syntheses: list[Synthesis] = []

    async def tts_node(
        self, text: AsyncIterable[str], model_settings: ModelSettings
    ) -> AsyncGenerator[rtc.AudioFrame, None]:
        synthesis = Synthesis(began=time.monotonic())
        self.syntheses.append(synthesis)
        try:
            async for frame in Agent.default.tts_node(self, text, model_settings):
                synthesis.audio_s += frame.duration
                yield frame
            synthesis.finished = True
        finally:
            synthesis.ended = time.monotonic()


def speculating_session(
    engine: OrpheusEngine,
    turns: list[UserTurn],
    replies: dict[str, str],
    *,
    preemptive_tts: bool,
    max_retries: int = 3,
) -> AgentSession:
    """A session on scripted VAD, STT and LLM that speculates on every final transcript and speaks through Orpheus."""
    return AgentSession(
        vad=ScriptedVAD(turns),
        stt=ScriptedSTT(turns),
        llm=ScriptedLLM(replies),
        tts=orpheus.TTS(engine=engine, voice="leo"),
        turn_handling={
            "turn_detection": "vad",
            "endpointing": {"min_delay": ENDPOINTING_S, "max_delay": 2.0},
            "interruption": {"mode": "vad", "min_duration": 0.2, "resume_false_interruption": False},
            "preemptive_generation": {"preemptive_tts": preemptive_tts, "max_retries": max_retries},
        },
        use_tts_aligned_transcript=True,
        aec_warmup_duration=None,
        user_away_timeout=None,
        session_close_transcript_timeout=0.1,  # no transcript is pending at the close: don't wait 2 s for one
    )


@dataclass
class Call:
    """What one conversation left behind: the agent's records, the speaker's, and when the turn was confirmed."""

    agent: SynthesisRecorder
    speaker: VirtualSpeaker
    played: list[PlaybackFinishedEvent] = field(default_factory=list)
    heard_at: list[float] = field(default_factory=list)  # time.monotonic() of each playback's first audio
    transcribed_at: list[float] = field(default_factory=list)  # time.monotonic() of each final transcript
    confirmed_at: list[float] = field(default_factory=list)  # of each user message committed (its turn confirmed)

    def after_the_turn(self, synthesis: Synthesis) -> bool:
        """Whether `synthesis` began at the end of the turn, not on the last transcript (a speculation)."""
        return synthesis.began > self.transcribed_at[-1] + ENDPOINTING_S / 2


async def converse(session: AgentSession, timeout: float = 20.0) -> Call:
    """Run `session` until its first reply has played out and is in the chat context; the output is LiveKit's
    `TranscriptSynchronizer` in front of a virtual speaker, as `RoomIO` puts it."""
    call = Call(SynthesisRecorder(), VirtualSpeaker())
    synchronizer = TranscriptSynchronizer(next_in_chain_audio=call.speaker, next_in_chain_text=None)
    session.input.audio = SilentAudioInput()
    session.output.audio = synchronizer.audio_output
    session.output.transcription = synchronizer.text_output
    call.speaker.on("playback_finished", call.played.append)
    call.speaker.on("playback_started", lambda _: call.heard_at.append(time.monotonic()))

    def committed(ev: ConversationItemAddedEvent) -> None:
        if ev.item.type == "message" and ev.item.role == "user":
            call.confirmed_at.append(time.monotonic())

    session.on("conversation_item_added", committed)
    session.on("user_input_transcribed", lambda ev: ev.is_final and call.transcribed_at.append(time.monotonic()))
    await session.start(call.agent)
    try:
        await asyncio.wait_for(until_true(lambda: bool(call.played) and _reply(call.agent) is not None), timeout)
    finally:
        await session.aclose()
        await synchronizer.aclose()
    return call


def _reply(agent: Agent) -> llm.ChatMessage | None:
    """The agent's first reply in its chat context, if there is one yet."""
    return next((i for i in agent.chat_ctx.items if i.type == "message" and i.role == "assistant"), None)


async def _no_stream_open(engine: OrpheusEngine) -> None:
    await asyncio.wait_for(until_true(lambda: engine.stats()["active_streams"] == 0), timeout=2)


def assert_only_the_confirmed_reply_was_heard(call: Call, confirmed: Synthesis) -> None:
    """The confirmed synthesis played whole and alone, and the transcript and context hold its words only."""
    (playback,) = call.played
    assert not playback.interrupted
    assert confirmed.finished and confirmed.audio_s > 0.5
    assert call.speaker.captured == pytest.approx(confirmed.audio_s, abs=1e-3)  # no other synthesis's audio
    reply = _reply(call.agent)
    assert reply is not None and not reply.interrupted and (reply.text_content or "").split() == REPLY.split()
    assert "".join(call.agent.timed).split() == REPLY.split()  # aligned words of this reply alone, each once
    (asked,) = [i for i in call.agent.chat_ctx.items if i.type == "message" and i.role == "user"]
    assert asked.text_content == ASKED


@pytest.mark.parametrize("preemptive_tts", [True, False], ids=["preemptive-tts", "preemptive-llm-only"])
async def test_a_reply_discarded_when_the_caller_goes_on_is_never_heard_and_the_confirmed_one_plays_whole(
    engine: OrpheusEngine, preemptive_tts: bool
) -> None:
    # "Tell me" then a pause shorter than the endpointing delay: LiveKit answers it preemptively, then the caller goes
    # on, and the new transcript discards that reply and starts one to the whole question.
    turns = [UserTurn(0.2, 0.6, "Tell me"), UserTurn(1.0, 1.6, "a story.")]
    session = speculating_session(engine, turns, {"Tell me": WRONG, ASKED: REPLY}, preemptive_tts=preemptive_tts)
    before = engine.stats()

    call = await converse(session)
    await _no_stream_open(engine)

    (confirmed_at,) = call.confirmed_at
    if preemptive_tts:
        discarded, confirmed = call.agent.syntheses
        assert discarded.began < confirmed.began < confirmed_at and not call.after_the_turn(confirmed)
        assert discarded.ended is not None and discarded.ended < confirmed_at
        if engine.config.synthetic.tokens_per_second:  # paced: still being made when discarded
            assert not discarded.finished
            if discarded.audio_s:  # (it had reached the engine, as it does unless the host stalls for a second)
                assert engine.stats()["streams_cancelled"] > before.get("streams_cancelled", 0)  # request aborted
    else:  # the LLM alone ran ahead: the one synthesis starts after the turn is confirmed
        (confirmed,) = call.agent.syntheses
        assert call.after_the_turn(confirmed)
    assert_only_the_confirmed_reply_was_heard(call, confirmed)


async def test_speculative_syntheses_stop_at_max_retries_a_turn_and_the_reply_then_follows_the_turn(
    engine: OrpheusEngine,
) -> None:
    # Three final transcripts in one turn, two speculations allowed: the third transcript only cancels the second.
    turns = [UserTurn(0.2, 0.5, "Tell"), UserTurn(0.9, 1.2, "me"), UserTurn(1.6, 1.9, "a story.")]
    replies = {"Tell": WRONG, "Tell me": WRONG, ASKED: REPLY}
    session = speculating_session(engine, turns, replies, preemptive_tts=True, max_retries=2)

    call = await converse(session)
    await _no_stream_open(engine)

    (confirmed_at,) = call.confirmed_at
    first, second, confirmed = call.agent.syntheses
    if engine.config.synthetic.tokens_per_second:  # still generating when discarded
        assert not first.finished and not second.finished
    assert first.ended is not None and second.ended is not None and max(first.ended, second.ended) < confirmed_at
    assert call.after_the_turn(confirmed)  # no third speculation
    assert_only_the_confirmed_reply_was_heard(call, confirmed)


# ------------------------------------------------------------------------------------------- what it costs
# The caller pauses mid-sentence (0.4 s, under the endpointing delay) and goes on for 1.5 s.
COST_TURNS = [UserTurn(0.2, 1.4, "I would like to book a table"), UserTurn(1.8, 3.3, "for four people tonight.")]
COST_ASKED = "I would like to book a table for four people tonight."
COST_REPLIES = {
    "I would like to book a table": "Sure, I can help with that. For how many people, and at what time?",
    COST_ASKED: REPLY,
}


async def _cost(config: EngineConfig, pace: float, runs: int) -> None:
    """Print, per call, the syntheses discarded and what the engine spent; the same call with the LLM alone
    speculating spends the confirmed reply's alone."""
    engine = OrpheusEngine(replace(config, synthetic=SyntheticConfig(tokens_per_second=pace)))
    await engine.start()
    label = f"{pace:g} tokens/s a stream" if pace else "unpaced"
    for preemptive_tts in (False, True):
        for _ in range(runs):
            before = engine.stats()
            session = speculating_session(engine, COST_TURNS, COST_REPLIES, preemptive_tts=preemptive_tts)
            call = await converse(session, timeout=30)
            await _no_stream_open(engine)
            after = engine.stats()
            spent = {k: after.get(k, 0) - before.get(k, 0) for k in ("tokens", "streams_started", "streams_cancelled")}
            *discarded, confirmed = call.agent.syntheses
            held = sum((s.ended or s.began) - s.began for s in discarded)
            print(
                f"{label}, preemptive_tts={preemptive_tts}: turns {len(call.confirmed_at)};"
                f" {len(discarded)} discarded, held {held:.2f} s,"
                f" {sum(s.audio_s for s in discarded):.2f} s of audio made, {sum(s.finished for s in discarded)}"
                f" of them finished; confirmed: {confirmed.audio_s:.2f} s of audio; engine: {spent};"
                f" turn confirmed -> first audio {(call.heard_at[0] - call.confirmed_at[0]) * 1000:.0f} ms"
            )
    await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="engine work spent on discarded preemptive syntheses (LiveKit)")
    parser.add_argument(
        "snac", help="a SNAC folder, e.g. the tiny one of `orpheus-tts make-test-model DIR --snac tiny`"
    )
    parser.add_argument("--pace", type=float, action="append", help="tokens/s a stream (0: unpaced); repeatable")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("livekit.agents").setLevel(logging.ERROR)
    base = EngineConfig(model=None, backend="synthetic", snac=args.snac, device="cpu")
    for pace in args.pace or [0.0, 100.0]:
        asyncio.run(_cost(base, pace, args.runs))
