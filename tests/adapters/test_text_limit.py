"""The engine's text limit (EngineConfig.max_text_chars) against an LLM reply longer than it: each adapter passes
the reply on a sentence at a time, so neither ever meets the limit, and every word is spoken.

A reply of 4,165 characters, over the default limit of 4,096, streamed word by word as an LLM streams it, through
Pipecat's `OrpheusTTSService` and LiveKit's `TTS.stream()`, on an engine with the default limit, generation
faster than decoding and slower. Each sentence is one frame of audio: the test is of the text's path, not the audio.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from livekit.agents.tts import TTSError
from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame, TTSTextFrame

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.config import MAX_TEXT_CHARS
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService
from tests.adapters.test_pipecat import PACINGS, closing_engine, errors, run

CLAUSE = "as a chatty model's replies do, and then some more"
SENTENCES = [f"Sentence {i} of this long reply goes on, {', '.join([CLAUSE] * 4)}, for a while." for i in range(16)]
REPLY = " ".join(SENTENCES)  # 16 sentences of about 260 characters


@pytest.fixture(scope="module", params=sorted(PACINGS))
def engine(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> Iterator[OrpheusEngine]:
    """The default text limit; each sentence is one frame of audio."""
    synthetic = SyntheticConfig(PACINGS[request.param], frames_per_prompt_token=0.0, min_frames=1)
    config = replace(synthetic_config, synthetic=synthetic)
    assert config.max_text_chars == MAX_TEXT_CHARS < len(REPLY)
    yield from closing_engine(config)


def test_the_reply_is_over_the_engines_limit_in_one_call(engine: OrpheusEngine) -> None:
    with pytest.raises(ValueError, match=f"over the engine's limit of {MAX_TEXT_CHARS}"):
        engine.synthesize(REPLY)


async def test_pipecat_speaks_a_reply_over_the_limit_sentence_by_sentence(engine: OrpheusEngine) -> None:
    before = engine.stats().get("utterances", 0)
    words = [LLMTextFrame(w + " ") for w in REPLY.split(" ")]
    down, up = await run(
        OrpheusTTSService(engine=engine), [LLMFullResponseStartFrame(), *words, LLMFullResponseEndFrame()]
    )
    assert not errors(up)
    assert [f.text for f in down if isinstance(f, TTSTextFrame)] == REPLY.split()
    assert engine.stats()["utterances"] - before >= len(REPLY) // engine.config.sentence_max_chars


async def test_livekit_speaks_a_reply_over_the_limit_sentence_by_sentence(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine)
    failures: list[TTSError] = []
    tts.on("error", failures.append)
    started = engine.stats()["streams_started"]
    async with tts.stream() as stream:
        for word in REPLY.split(" "):
            stream.push_text(word + " ")
        stream.flush()
        stream.end_input()
        events = [ev async for ev in stream]
    assert not failures
    assert events and events[-1].is_final
    assert engine.stats()["streams_started"] - started >= len(REPLY) // engine.config.sentence_max_chars
