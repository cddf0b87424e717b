"""Speech from the first phrase (issue 37, point 3): the rule, then Pipecat's service and LiveKit's stream with it.

The rule is plain text in, cut out. The adapters are run as the other adapter tests run them: real Pipecat
pipelines and real LiveKit streams and sessions, on the synthetic engine with generation faster than decoding and
slower; word timestamps and a barge-in reuse those tests' harnesses with the option on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSTextFrame,
)
from pipecat.services.tts_service import TextAggregationMode

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.pipecat.tts import FirstPhraseTextAggregator, OrpheusTTSService
from orpheus_tts_plugin.speech.first_phrase import Cut, FirstPhrase, FirstPhraseSplitter
from orpheus_tts_plugin.types import Speech
from tests.adapters.test_pipecat import (  # noqa: F401 - replying_engine: a fixture, used by name
    REPLY,
    Marker,
    Speaker,
    audio_by_context,
    closing_engine,
    errors,
    paced,
    replying_engine,
    run,
    running_pipeline,
    speak_and_interrupt,
    wait_until,
)

REPLY_TEXT = "Of course, I can book a table for you. What time would you like, and for how many?"
PHRASE, REST = "Of course,", ["I can book a table for you.", "What time would you like, and for how many?"]


def pieces(text: str) -> list[str]:
    """`text` as an LLM streams it: a word and its space at a time."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize(
    "text, found",
    [
        ("Of course, I", (Cut.PHRASE, len("Of course,"))),
        ("Of course,", (Cut.WAIT, 0)),  # the mark's next character has not come: "course,5" would be no mark
        ("Sure, of course, I", (Cut.PHRASE, len("Sure, of course,"))),  # "Sure," has too few words
        ("Well - we have 1,000 seats: any", (Cut.PHRASE, len("Well - we have 1,000 seats:"))),
        ("Yes. Of course, I", (Cut.SENTENCE, 0)),  # the first sentence ended first: it is spoken whole
        ("We are open from nine", (Cut.WAIT, 0)),
    ],
)
def test_the_first_phrase_ends_at_the_first_clause_mark_after_enough_words_unless_a_sentence_ends_first(
    text: str, found: tuple[Cut, int]
) -> None:
    assert FirstPhrase(min_words=2).find(text) == found


def test_a_reply_fed_piece_by_piece_gives_its_phrase_once_and_everything_else_in_order() -> None:
    splitter = FirstPhraseSplitter(FirstPhrase(min_words=2))
    out = [splitter.feed(p) for p in pieces(REPLY_TEXT)]
    assert [phrase for phrase, _ in out if phrase] == [PHRASE]
    assert "".join(rest for _, rest in out) + splitter.finish() == REPLY_TEXT[len(PHRASE) :]
    with pytest.raises(ValueError):
        FirstPhrase(min_words=0)


# ------------------------------------------------------------------ Pipecat
@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig, pacing: str) -> Iterator[OrpheusEngine]:  # noqa: F811
    yield from closing_engine(paced(synthetic_config, pacing))


def requested(service: OrpheusTTSService) -> list[str]:
    """The texts the service hands its engine, in order (Pipecat's `on_tts_request` event)."""
    texts: list[str] = []

    @service.event_handler("on_tts_request")
    async def note(_service: OrpheusTTSService, _context_id: str, text: str) -> None:
        texts.append(text)

    return texts


async def test_pipecat_speaks_the_first_phrase_then_sentences_in_one_context_with_every_word_timed(
    engine: OrpheusEngine,
) -> None:
    service = OrpheusTTSService(engine=engine, first_phrase=2)
    texts = requested(service)
    reply = [LLMFullResponseStartFrame(), *[LLMTextFrame(p) for p in pieces(REPLY_TEXT)], LLMFullResponseEndFrame()]
    down, up = await run(service, reply)
    assert [t.strip() for t in texts] == [PHRASE, *REST]
    words = [f for f in down if isinstance(f, TTSTextFrame)]
    assert [f.text for f in words] == REPLY_TEXT.split()
    assert all(f.pts for f in words) and [f.pts for f in words] == sorted(f.pts for f in words)
    assert len(audio_by_context(down)) == 1  # one context for the reply, as without the option
    assert not errors(up)


async def test_pipecat_without_the_option_still_waits_for_the_first_sentence(engine: OrpheusEngine) -> None:
    service = OrpheusTTSService(engine=engine)
    texts = requested(service)
    await run(service, [LLMFullResponseStartFrame(), *[LLMTextFrame(p) for p in pieces(REPLY_TEXT)]])
    assert [t.strip() for t in texts] == [f"{PHRASE} {REST[0]}", REST[1]]
    with pytest.raises(ValueError, match="TOKEN"):
        OrpheusTTSService(engine=engine, first_phrase=2, text_aggregation_mode=TextAggregationMode.TOKEN)


async def test_pipecat_an_interruption_drops_the_held_text_and_the_next_reply_starts_with_its_own_phrase(
    engine: OrpheusEngine,
) -> None:
    service = OrpheusTTSService(engine=engine, first_phrase=2)
    texts = requested(service)
    async with running_pipeline(service) as p:
        await p.send(LLMFullResponseStartFrame(), LLMTextFrame("Well "), LLMTextFrame("then "), Marker("held"))
        await p.down.wait_for(lambda f: isinstance(f, Marker))  # the text before it is taken, and held: no mark yet
        await p.send(InterruptionFrame())
        await p.down.wait_for(lambda f: isinstance(f, InterruptionFrame))
        await p.send(LLMFullResponseStartFrame(), *[LLMTextFrame(x) for x in pieces(REPLY_TEXT)])
        await p.send(LLMFullResponseEndFrame())
        await wait_until(lambda: len(texts) == 3, timeout=30)
    assert [t.strip() for t in texts] == [PHRASE, *REST]  # nothing of the interrupted reply was spoken
    assert not p.up.of_type(ErrorFrame)


async def test_pipecat_an_aggregator_holds_its_text_until_the_reply_ends_and_gives_it_whole() -> None:
    aggregator = FirstPhraseTextAggregator(2)
    out = [a.text for p in pieces("Hello there") async for a in aggregator.aggregate(p)]
    assert out == [] and aggregator.text.text == "Hello there"
    assert (await aggregator.flush()).text == "Hello there"
    # a new reply: "Yes," is 1 word, so no phrase is cut; its sentence goes once its end is followed by a space
    assert [a.text async for a in aggregator.aggregate("Yes, we do. ")] == ["Yes, we do."]
    assert await aggregator.flush() is None


async def test_pipecat_a_barge_in_leaves_the_assistant_message_holding_the_words_played(
    replying_engine: OrpheusEngine,  # noqa: F811 - the fixture imported above
) -> None:
    async def two_seconds_played(speaker: Speaker) -> None:
        await wait_until(lambda: speaker.played() >= 2.0, timeout=60)  # inside the first phrase (~4 s, stalled)

    said, played = await speak_and_interrupt(replying_engine, two_seconds_played, first_phrase=3)
    assert REPLY.index(",") > 0  # the reply's first phrase: "... on Saturdays,"
    assert len(played) >= 5 and abs(len(said) - len(played)) <= 1, (said, played)
    assert replying_engine.stats()["active_streams"] == 0


# ------------------------------------------------------------------ LiveKit
class RecordingEngine:
    """The engine, noting every text it is asked to speak (everything else is the engine's own)."""

    def __init__(self, engine: OrpheusEngine):
        self._engine = engine
        self.texts: list[str] = []

    def synthesize(self, text: str, **kwargs: Any) -> Speech:
        self.texts.append(text)
        return self._engine.synthesize(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module", params=[0.0, 300.0], ids=["fast-generation", "paced-generation"])
def livekit_engine(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> Iterator[OrpheusEngine]:
    synthetic = SyntheticConfig(tokens_per_second=request.param, frames_per_prompt_token=0.5)
    engine = OrpheusEngine(replace(synthetic_config, synthetic=synthetic))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


async def speak_stream(tts: orpheus.TTS, text: str) -> list[Any]:
    async with tts.stream() as stream:
        for piece in pieces(text):
            stream.push_text(piece)
        stream.flush()
        stream.end_input()
        return [ev async for ev in stream]


async def test_livekit_speaks_the_first_phrase_then_sentences_in_one_segment_with_every_word_timed(
    livekit_engine: OrpheusEngine,
) -> None:
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

    engine = RecordingEngine(livekit_engine)
    events = await speak_stream(orpheus.TTS(engine=engine, first_phrase=2), REPLY_TEXT)  # type: ignore[arg-type]
    assert [t.strip() for t in engine.texts] == [PHRASE, *REST]
    assert len({ev.segment_id for ev in events}) == 1 and events[-1].is_final
    words = [w for ev in events for w in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(words).split() == REPLY_TEXT.split()
    assert [w.start_time for w in words] == sorted(w.start_time for w in words)

    engine.texts.clear()
    await speak_stream(orpheus.TTS(engine=engine), REPLY_TEXT)  # type: ignore[arg-type]
    assert [t.strip() for t in engine.texts] == [f"{PHRASE} {REST[0]}", REST[1]]  # off by default: sentences whole


async def test_livekit_closing_a_stream_mid_reply_aborts_its_request(livekit_engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=livekit_engine, first_phrase=2)
    cancelled = livekit_engine.stats().get("streams_cancelled", 0)
    stream = tts.stream()
    for piece in pieces(REPLY_TEXT)[:4]:  # the phrase and a little more, as an LLM still streaming
        stream.push_text(piece)
    first = await asyncio.wait_for(stream.__anext__(), 10)
    assert first.frame.samples_per_channel > 0
    await stream.aclose()  # the barge-in: LiveKit closes the reply's stream
    await wait_until(lambda: livekit_engine.stats()["active_streams"] == 0, timeout=5)
    if livekit_engine.config.synthetic.tokens_per_second:  # still generating when closed
        assert livekit_engine.stats()["streams_cancelled"] > cancelled
