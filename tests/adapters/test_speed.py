"""`speed` everywhere a user can ask for it: the engine's stream (stretched after decoding, its sentences and flags
kept, a barge-in still aborting within one step), the WebSocket `start` through `RemoteEngine`, Pipecat's `speed`
setting, LiveKit's `TTS(speed=)`, word timestamps placed in the stretched audio; out of range: an error naming it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import run_test

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, RemoteEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.speech.stretch import FEED_SAMPLES
from orpheus_tts_plugin.speech.words import WordTimer
from orpheus_tts_plugin.types import AudioChunk
from orpheus_tts_plugin.wire import protocol
from tests.served import PACES, TEXT, engine_of, idle, pcm_of, serving, until

SPEED = 2.0


def slack(engine: OrpheusEngine) -> int:
    """Samples a stretched stream's length may differ by: two of the stretch's frames a sentence (WSOLA's splices
    follow the audio, which the decoder's batching moves by a step or two)."""
    return 2 * FEED_SAMPLES * len(engine.sentences(TEXT))


@pytest.fixture(scope="module", params=list(PACES))
def served(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[ServerThread]:
    synthetic = SyntheticConfig(tokens_per_second=PACES[request.param])
    with serving(replace(synthetic_config, synthetic=synthetic)) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(served: ServerThread) -> Iterator[OrpheusEngine]:
    """The served engine, used in process too (the reference every way in is held to)."""
    yield engine_of(served)


async def chunks_of(engine: object, **options: object) -> list[AudioChunk]:
    return [c async for c in engine.synthesize(TEXT, seed=4, **options)]  # type: ignore[attr-defined]


async def test_a_stretched_stream_keeps_its_sentences_and_flags_at_1_over_speed_of_the_length(
    engine: OrpheusEngine,
) -> None:
    normal, fast = await chunks_of(engine), await chunks_of(engine, speed=SPEED)
    assert [c.final for c in fast].count(True) == 1 and fast[-1].final
    ends = [c.utterance for c in fast if c.utterance_end]
    assert ends == [c.utterance for c in normal if c.utterance_end] == list(range(len(engine.sentences(TEXT))))
    assert [c.start_sample for c in fast] == list(np.cumsum([0] + [c.num_samples for c in fast[:-1]]))
    for sentence in ends:
        heard = sum(c.num_samples for c in normal if c.utterance == sentence)
        stretched = sum(c.num_samples for c in fast if c.utterance == sentence)
        assert abs(stretched - heard / SPEED) <= 2 * FEED_SAMPLES


async def test_leaving_a_stretched_stream_aborts_its_engine_request_within_one_step(
    served: ServerThread, engine: OrpheusEngine
) -> None:
    stream = engine.synthesize(" ".join([TEXT] * 4), speed=0.5)
    await stream.__anext__()
    await stream.aclose()  # a barge-in
    await until(lambda: idle(served))
    assert engine.stats()["backend"]["max_steps_to_abort"] <= 1


async def test_a_remote_engine_sends_speed_in_its_start_and_gets_the_servers_stretch(
    served: ServerThread, engine: OrpheusEngine
) -> None:
    remote = RemoteEngine(served.url)
    try:
        got = sum(c.num_samples for c in await chunks_of(remote, speed=SPEED))
        with pytest.raises(ValueError, match=r"speed must be in \[0.25, 4\]"):
            remote.check_options(speed=4.5)
    finally:
        await remote.aclose()
    assert abs(got - sum(c.num_samples for c in await chunks_of(engine, speed=SPEED))) <= slack(engine)
    assert protocol.Start.parse(protocol.Start(TEXT, speed=SPEED).message(1)).speed == SPEED
    with pytest.raises(ValueError, match="speed"):
        protocol.Start.parse({"type": "start", "id": 1, "text": TEXT, "speed": 0.1})


async def test_word_timestamps_are_placed_in_the_stretched_audio(engine: OrpheusEngine) -> None:
    def last_word_end(chunks: list[AudioChunk], speed: float) -> float:
        timer = WordTimer(engine.sentences(TEXT), speed=speed)
        words = [w for c in chunks for w in timer.feed(c)]
        assert [w.text for w in words] == TEXT.split()
        return words[-1].end_s

    normal, fast = await chunks_of(engine), await chunks_of(engine, speed=SPEED)
    total = sum(c.num_samples for c in fast) / fast[0].sample_rate
    assert last_word_end(fast, SPEED) <= total
    assert abs(last_word_end(fast, SPEED) - last_word_end(normal, 1.0) / SPEED) <= 0.15


async def test_pipecats_speed_setting_stretches_the_services_audio(engine: OrpheusEngine) -> None:
    service = OrpheusTTSService(engine=engine, settings=OrpheusTTSService.Settings(speed=SPEED, seed=4))
    down, _ = await run_test(
        service,
        frames_to_send=[TTSSpeakFrame(TEXT)],
        pipeline_params=PipelineParams(audio_out_sample_rate=24_000),
        start_timeout=60,
    )
    got = sum(len(f.audio) // 2 for f in down if isinstance(f, TTSAudioRawFrame))
    assert abs(got - (await pcm_of(engine, seed=4, speed=SPEED)).size) <= slack(engine)


async def test_livekits_tts_speed_stretches_and_survives_other_option_changes(served: ServerThread) -> None:
    remote = RemoteEngine(served.url)
    try:
        tts = orpheus.TTS(engine=remote, speed=SPEED, seed=4)
        tts.update_options(temperature=0.6)
        got = sum([ev.frame.samples_per_channel async for ev in tts.synthesize(TEXT)])
        with pytest.raises(ValueError, match=r"\[0.25, 4\]"):
            orpheus.TTS(engine=remote, speed=0.2)
    finally:
        await remote.aclose()
    reference = (await pcm_of(engine_of(served), seed=4, temperature=0.6, speed=SPEED)).size
    assert abs(got - reference) <= slack(engine_of(served))
