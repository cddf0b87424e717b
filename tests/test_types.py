"""What callers see of an engine: a Speech carries its sentences; checked options are passed on, not re-checked."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncGenerator, Iterator

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, Speech
from orpheus_tts_plugin.types import AudioChunk


@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    engine = OrpheusEngine(synthetic_config)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


async def _utterances(speech: Speech) -> list[int]:
    return [chunk.utterance async for chunk in speech]


def test_a_speech_is_an_async_generator_whose_sentences_its_chunks_index(engine: OrpheusEngine) -> None:
    text = "Hello there. How are you today? " * 12  # longer than sentence_max_chars: spoken in several requests
    speech = engine.synthesize(text, seed=3)
    assert isinstance(speech, AsyncGenerator)
    assert speech.sentences == tuple(engine.sentences(text)) and len(speech.sentences) > 1
    assert sorted(set(asyncio.run(_utterances(speech)))) == list(range(len(speech.sentences)))


def test_checked_options_unpack_as_voice_and_sampling(engine: OrpheusEngine) -> None:
    options = engine.check_options("leo", temperature=0.3)
    voice, sampling = options
    assert (voice, sampling.temperature, options.overrides.temperature) == ("leo", 0.3, 0.3)
    assert sampling.top_p == engine.config.sampling.top_p  # the engine's default filled in; not an override
    assert options.overrides.top_p is None


def test_options_from_check_options_speak_as_the_same_values_given_directly(engine: OrpheusEngine) -> None:
    async def pcm(**kwargs: object) -> bytes:
        return b"".join([c.pcm async for c in engine.synthesize("Hello there.", **kwargs)])

    options = engine.check_options("dan", seed=11)
    assert asyncio.run(pcm(options=options)) == asyncio.run(pcm(voice="dan", seed=11))


def test_synthesize_with_options_does_not_check_them_again(
    engine: OrpheusEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = engine.check_options(seed=1)
    monkeypatch.setattr(engine, "check_options", lambda *a, **k: pytest.fail("checked twice"))

    async def speak() -> int:
        return len([c async for c in engine.synthesize("Hi.", options=options)])

    assert asyncio.run(speak()) > 0


def test_options_together_with_voice_or_sampling_values_are_refused(engine: OrpheusEngine) -> None:
    options = engine.check_options()
    with pytest.raises(TypeError, match="either options or voice/adapter/sampling"):
        engine.synthesize("Hi.", options=options, seed=1)
    with pytest.raises(TypeError, match="options must be SpeechOptions"):
        engine.synthesize("Hi.", options=("tara", None))  # type: ignore[arg-type]


def test_leaving_a_speech_early_closes_its_generation(engine: OrpheusEngine) -> None:
    async def leave() -> AudioChunk:
        speech = engine.synthesize("A sentence long enough to come in several chunks of audio.", seed=2)
        async with contextlib.aclosing(speech):
            first = await speech.__anext__()
        with pytest.raises(StopAsyncIteration):
            await speech.__anext__()
        return first

    assert asyncio.run(leave()).start_sample == 0
    assert engine.stats()["active_streams"] == 0


def test_a_speech_takes_a_weak_reference_that_dies_with_it_as_a_generators_does(engine: OrpheusEngine) -> None:
    async def weakly_held() -> weakref.ref[Speech]:
        speech = engine.synthesize("Hi.", seed=4)
        ref = weakref.ref(speech)
        assert ref() is speech and len([c async for c in speech]) > 0
        return ref

    ref = asyncio.run(weakly_held())
    gc.collect()
    assert ref() is None
