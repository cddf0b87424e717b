"""Speaking ahead: a reply spoken while the caller's turn is still being confirmed, held, released or discarded.

The room (reply.py, framework-free) on the engine; then OrpheusTTSService in real Pipecat pipelines with the real
user aggregator driven by `SpeakAheadUserTurnStopStrategy` (pipecat/turns.py): the turn ends at the VAD stop with
the reply's audio held, the confirming strategy's verdict releases it, and a caller who goes on discards it through
Pipecat's own barge-in. Each at both paces (generation faster than decoding, and slower); what the tests wait for
are frames and engine counters, never a timer's luck: a turn that must not be confirmed has a confirmation timeout
no test outlives.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.frames.frames import (
    InterruptionFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSTextFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.processors.frame_processor import FrameDirection
from pipecat.turns.user_start.vad_user_turn_start_strategy import VADUserTurnStartStrategy
from pipecat.turns.user_stop.speech_timeout_user_turn_stop_strategy import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies

from orpheus_tts_plugin import OrpheusEngine
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService
from orpheus_tts_plugin.pipecat.turns import ReplyHoldFrame, ReplyReleaseFrame, SpeakAheadUserTurnStopStrategy
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.first_phrase import FirstPhrase
from orpheus_tts_plugin.speech.reply import ReplyDiscarded, ReplySpeech, ReplyText
from orpheus_tts_plugin.speech.words import Pace
from tests.adapters.test_pipecat import (
    ScriptedLLM,
    Speaker,
    assert_audio_matches,
    audio_by_context,
    engine_pcm,
    errors,
    running_pipeline,
    wait_until,
)

REPLY = "We are open from nine to five. On Saturdays we open at ten."
NEVER_S = 600.0  # a confirmation timeout no test outlives: that turn is never confirmed by the timer


# ------------------------------------------------------------------ the room
def test_reply_text_gives_the_first_phrase_then_each_sentence_once_the_next_begins() -> None:
    text = ReplyText(FirstPhrase(3))
    out = [
        piece
        for word in "Well, of course, I can book that. What time? Seven".split(" ")
        for piece in text.feed(word + " ")
    ]
    assert out == ["Well, of course,", "I can book that.", "What time?"]
    assert text.held == "Seven" and text.finish() == ["Seven"]


def speaking_held(engine: OrpheusEngine) -> tuple[ReplySpeech, list[bytes], asyncio.Task[None]]:
    """A held reply speaking REPLY in a task of its own, and the audio it has given out so far."""
    reply = ReplySpeech(engine, engine.check_options(seed=1), Pace(), held=True)
    got: list[bytes] = []

    async def speak() -> None:
        got.extend([spoken.chunk.pcm async for spoken in reply.speak(REPLY)])

    return reply, got, asyncio.create_task(speak())


async def test_a_held_reply_gives_out_nothing_until_released_then_all_of_it(engine: OrpheusEngine) -> None:
    reply, got, task = speaking_held(engine)
    await wait_until(lambda: engine.stats()["active_streams"] == 1, timeout=30)  # the engine is speaking it
    await asyncio.sleep(0.2)
    assert got == [] and reply.held
    reply.release()
    await asyncio.wait_for(task, 30)
    assert_audio_matches(b"".join(got), await engine_pcm(engine, REPLY, seed=1))


async def test_a_discarded_reply_aborts_its_engine_stream_and_gives_out_nothing(held_engine: OrpheusEngine) -> None:
    reply, got, task = speaking_held(held_engine)
    await wait_until(lambda: held_engine.stats()["active_streams"] == 1, timeout=30)
    await reply.discard()
    with pytest.raises(ReplyDiscarded):
        await asyncio.wait_for(task, 30)
    await wait_until(lambda: held_engine.stats()["active_streams"] == 0, timeout=5)
    assert got == [] and held_engine.stats()["streams_cancelled"] == 1


# ------------------------------------------------------------------ Pipecat
async def test_pipecat_holds_a_reply_after_a_hold_frame_and_plays_it_whole_at_the_release(
    engine: OrpheusEngine,
) -> None:
    async with running_pipeline(OrpheusTTSService(engine=engine, settings=OrpheusTTSService.Settings(seed=1))) as p:
        await p.send(ReplyHoldFrame(), TTSSpeakFrame(REPLY))
        await wait_until(lambda: engine.stats()["active_streams"] == 1, timeout=30)
        await asyncio.sleep(0.2)
        assert not p.down.of_type(TTSAudioRawFrame, TTSTextFrame)
        await p.send(ReplyReleaseFrame())
        await p.down.wait_for(lambda f: isinstance(f, TTSTextFrame) and f.text.startswith("ten"), timeout=30)
    [audio] = audio_by_context(p.down.received()).values()
    assert_audio_matches(audio, await engine_pcm(engine, REPLY, seed=1))
    assert not errors(p.up.received())


def speak_ahead_pipeline(engine: OrpheusEngine, confirm_after_s: float) -> tuple[Pipeline, LLMContext, Speaker]:
    """user aggregator (speaking ahead, confirmed after `confirm_after_s`) → LLM → TTS → speaker → assistant."""
    context = LLMContext()
    stop = SpeakAheadUserTurnStopStrategy(SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=confirm_after_s))
    strategies = UserTurnStrategies(start=[VADUserTurnStartStrategy()], stop=[stop])
    pair = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(user_turn_strategies=strategies))
    speaker = Speaker()
    tts = OrpheusTTSService(engine=engine)
    return Pipeline([pair.user(), ScriptedLLM(REPLY), tts, speaker, pair.assistant()]), context, speaker


def said(text: str) -> list:
    """The caller saying `text` and pausing: the VAD's start, the final transcript, the VAD's stop."""
    return [
        VADUserStartedSpeakingFrame(),
        TranscriptionFrame(text, "caller", "", finalized=True),
        VADUserStoppedSpeakingFrame(stop_secs=0.2),
    ]


async def test_pipecat_a_caller_who_goes_on_discards_the_held_reply_and_nothing_of_it_is_heard_or_kept(
    held_engine: OrpheusEngine,
) -> None:
    pipeline, context, speaker = speak_ahead_pipeline(held_engine, confirm_after_s=NEVER_S)
    async with running_pipeline(pipeline, PipelineParams(audio_out_sample_rate=SAMPLE_RATE)) as p:
        await p.send(*said("What are your opening hours on"))
        await p.down.wait_for(lambda f: isinstance(f, ReplyHoldFrame))
        await wait_until(lambda: held_engine.stats()["active_streams"] == 1, timeout=30)  # the reply is being spoken
        await p.send(VADUserStartedSpeakingFrame())  # the caller goes on: a new turn, Pipecat's barge-in
        await p.down.wait_for(lambda f: isinstance(f, InterruptionFrame))
        await wait_until(lambda: held_engine.stats()["active_streams"] == 0, timeout=5)
        await asyncio.sleep(0.3)  # audio or words still in flight anywhere would arrive now
        assert speaker.played() == 0.0
        assert not p.down.of_type(TTSAudioRawFrame, TTSTextFrame)
    messages = context.get_messages()
    assert [m["role"] for m in messages] == ["user"] and "assistant" not in str(messages)
    stats = held_engine.stats()  # one engine stream a sentence, each discarded
    assert stats["speculative_started"] == stats["speculative_discarded"] >= 1 and stats["speculative_confirmed"] == 0
    assert not errors(p.up.received())


async def test_pipecat_a_confirmed_turn_releases_the_reply_which_plays_whole_with_its_words(
    engine: OrpheusEngine,
) -> None:
    pipeline, context, speaker = speak_ahead_pipeline(engine, confirm_after_s=0.2)
    async with running_pipeline(pipeline, PipelineParams(audio_out_sample_rate=SAMPLE_RATE)) as p:
        await p.send(*said("When are you open"))
        hold = await p.down.wait_for(lambda f: isinstance(f, ReplyHoldFrame))
        release = await p.down.wait_for(lambda f: isinstance(f, ReplyReleaseFrame), timeout=30)
        first_audio = await p.down.wait_for(lambda f: isinstance(f, TTSAudioRawFrame), timeout=30)
        assert p.down.arrival(hold) <= p.down.arrival(release) <= p.down.arrival(first_audio)
        await wait_until(lambda: any(m["role"] == "assistant" for m in context.get_messages()), timeout=60)
    [assistant] = [m["content"] for m in context.get_messages() if m["role"] == "assistant"]
    assert assistant.split() == REPLY.split()
    assert speaker.played() > 0
    assert engine.stats()["active_streams"] == 0
    assert engine.stats()["speculative_confirmed"] >= 1
    assert not errors(p.up.received())


async def test_pipecat_hold_and_release_frames_travel_upstream_too_for_observers(engine: OrpheusEngine) -> None:
    pipeline, _context, _speaker = speak_ahead_pipeline(engine, confirm_after_s=0.2)
    async with running_pipeline(pipeline, PipelineParams(audio_out_sample_rate=SAMPLE_RATE)) as p:
        await p.send(*said("Hello"))
        await p.up.wait_for(lambda f: isinstance(f, ReplyReleaseFrame), timeout=30)
    assert p.up.direction is FrameDirection.UPSTREAM and p.up.of_type(ReplyHoldFrame)
