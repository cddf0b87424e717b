"""OrpheusTTSService through real Pipecat pipelines: frames, rates, metrics, settings, interruption, sharing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import numpy as np
import pytest
import soxr
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import run_test
from pipecat.workers.runner import WorkerRunner

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.pipecat import OrpheusTTSService

Settings = OrpheusTTSService.Settings
TEXT = "Hello there, thanks for calling the test line today."
LONG_TEXT = (
    "Thanks for calling. Our opening hours are nine to five on weekdays and ten to four on Saturdays, "
    "and we are closed on Sundays and public holidays, so please call back then if you need anything else."
)


# ------------------------------------------------------------------ harness
class Recorder(FrameProcessor):
    """Passes every frame on and records those travelling in `direction`, with their arrival time."""

    def __init__(self, direction: FrameDirection):
        super().__init__(enable_direct_mode=True)
        self.direction = direction
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self.direction:
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)

    def of_type(self, *types: type) -> list[Frame]:
        return [f for _, f in self.frames if isinstance(f, types)]

    async def wait_for(self, predicate: Callable[[Frame], bool], timeout: float = 20.0) -> Frame:
        """The first recorded frame matching `predicate`, waiting up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for _, frame in self.frames:
                if predicate(frame):
                    return frame
            if time.monotonic() > deadline:
                raise TimeoutError(f"no matching frame in {timeout} s: {[type(f).__name__ for _, f in self.frames]}")
            await asyncio.sleep(0.005)


@dataclass
class Running:
    """A running pipeline [upstream recorder, service, downstream recorder]."""

    worker: PipelineWorker
    down: Recorder
    up: Recorder

    async def send(self, *frames: Frame) -> None:
        await self.worker.queue_frames(frames)


@asynccontextmanager
async def running_pipeline(processor: FrameProcessor, params: PipelineParams | None = None) -> AsyncIterator[Running]:
    """Run `processor` in a PipelineWorker for the block, then end it with an EndFrame (which drains audio)."""
    up, down = Recorder(FrameDirection.UPSTREAM), Recorder(FrameDirection.DOWNSTREAM)
    pipeline = Pipeline([up, processor, down])
    worker = PipelineWorker(pipeline, params=params or PipelineParams(), cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    task = asyncio.create_task(runner.run())
    try:
        await down.wait_for(lambda f: isinstance(f, StartFrame), timeout=60)
        yield Running(worker, down, up)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(asyncio.shield(task), timeout=60)
    finally:
        if not task.done():
            await worker.cancel()
            await task


async def wait_until(condition: Callable[[], bool], timeout: float) -> float:
    """Seconds until `condition()` held; TimeoutError after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.002)
    return time.monotonic() - start


async def run(service: OrpheusTTSService, frames: list[Frame], **kwargs) -> tuple[list[Frame], list[Frame]]:
    """`run_test` with time for a first engine start (StartFrame waits for the engine to load)."""
    return await run_test(service, frames_to_send=frames, start_timeout=60, **kwargs)


async def engine_pcm(engine: OrpheusEngine, text: str, **options) -> bytes:
    """What the engine itself produces for `text` (the reference the service must deliver)."""
    return b"".join([chunk.pcm async for chunk in engine.synthesize(text, **options)])


def audio_by_context(frames: list[Frame]) -> dict[str, bytes]:
    """Concatenated TTSAudioRawFrame audio per context id, in order of first appearance."""
    out: dict[str, bytes] = {}
    for f in frames:
        if isinstance(f, TTSAudioRawFrame):
            out[f.context_id] = out.get(f.context_id, b"") + f.audio
    return out


def errors(frames: list[Frame]) -> list[ErrorFrame]:
    return [f for f in frames if isinstance(f, ErrorFrame)]


# ------------------------------------------------------------------ engines
def _engine(config: EngineConfig):
    engine = OrpheusEngine(config)
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig):
    """Synthetic tokens as fast as the thread steps, the real streaming decoder on the tiny SNAC."""
    yield from _engine(synthetic_config)


@pytest.fixture(scope="module")
def paced_engine(synthetic_config: EngineConfig):
    """Synthetic tokens at 150/s per stream (~1.8x real time), so an utterance is still generating when cut."""
    yield from _engine(replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=150.0)))


@pytest.fixture(scope="module")
def hf_engine(hf_config: EngineConfig):
    """The full stack on the tiny random Llama: the prompt (voice, text) changes the audio."""
    yield from _engine(hf_config)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("rate", [24_000, 16_000, 8_000])
async def test_speak_frame_yields_started_audio_at_pipeline_rate_then_stopped(engine: OrpheusEngine, rate: int):
    service = OrpheusTTSService(engine=engine, settings=Settings(seed=3))
    down, up = await run(service, [TTSSpeakFrame(TEXT)], pipeline_params=PipelineParams(audio_out_sample_rate=rate))
    tts = [f for f in down if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))]
    assert isinstance(tts[0], TTSStartedFrame) and isinstance(tts[-1], TTSStoppedFrame)
    audio = tts[1:-1]
    assert audio and all(isinstance(f, TTSAudioRawFrame) for f in audio)
    assert {(f.sample_rate, f.num_channels) for f in audio} == {(rate, 1)}
    assert {f.context_id for f in tts} == {tts[0].context_id}
    assert not errors(up)

    got = np.frombuffer(b"".join(f.audio for f in audio), dtype="<i2")
    reference = np.frombuffer(await engine_pcm(engine, TEXT, seed=3), dtype="<i2")
    if rate == 24_000:
        assert np.array_equal(got, reference)  # exactly the engine's audio, nothing added or lost
    else:
        expected = soxr.resample(reference, 24_000, rate, quality="VHQ")
        assert abs(got.size - expected.size) <= 2
        n = min(got.size, expected.size)
        err = np.abs(got[:n].astype(np.int32) - expected[:n].astype(np.int32))
        assert np.percentile(err, 99) <= 2, "streamed resampling must match a one-shot resample of the utterance"


async def test_reports_ttfb_and_usage_metrics(engine: OrpheusEngine):
    service = OrpheusTTSService(engine=engine)
    down, _ = await run(
        service,
        [TTSSpeakFrame(TEXT)],
        pipeline_params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
    )
    data = [d for f in down if isinstance(f, MetricsFrame) for d in f.data if d.processor == service.name]
    ttfb = [d.value for d in data if isinstance(d, TTFBMetricsData)]
    usage = [d.value for d in data if isinstance(d, TTSUsageMetricsData)]
    assert any(v > 0 for v in ttfb), ttfb
    assert len(TEXT) in usage


async def test_llm_text_is_spoken_sentence_by_sentence_in_one_context(engine: OrpheusEngine):
    service = OrpheusTTSService(engine=engine)
    before = engine.stats().get("utterances", 0)
    down, up = await run(
        service,
        [
            LLMFullResponseStartFrame(),
            *[LLMTextFrame(t) for t in ("Hello ", "there. ", "How are ", "you today? ", "Fine")],
            LLMFullResponseEndFrame(),
        ],
    )
    assert [f.text.strip() for f in down if isinstance(f, TTSTextFrame)] == [
        "Hello there.",
        "How are you today?",
        "Fine",
    ]
    assert len([f for f in down if isinstance(f, TTSStartedFrame)]) == 1
    assert len([f for f in down if isinstance(f, TTSStoppedFrame)]) == 1
    assert len(audio_by_context(down)) == 1
    assert engine.stats()["utterances"] - before == 3  # one engine request per aggregated sentence
    assert not errors(up)


async def test_interruption_aborts_the_engine_request_and_no_audio_of_that_context_follows(
    paced_engine: OrpheusEngine,
):
    service = OrpheusTTSService(engine=paced_engine)
    cancelled_before = paced_engine.stats().get("streams_cancelled", 0)
    async with running_pipeline(service) as p:
        await p.send(TTSSpeakFrame(LONG_TEXT))
        first = await p.down.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))
        assert paced_engine.stats()["active_streams"] == 1  # still generating

        await p.send(InterruptionFrame())
        interruption = await p.down.wait_for(lambda f: isinstance(f, InterruptionFrame))
        await wait_until(lambda: paced_engine.stats()["active_streams"] == 0, timeout=1.0)
        assert paced_engine.stats()["streams_cancelled"] - cancelled_before == 1
        await asyncio.sleep(0.5)  # audio still in flight anywhere would arrive now

        frames = [f for _, f in p.down.frames]
        after = frames[frames.index(interruption) :]
        assert not [f for f in after if isinstance(f, TTSAudioRawFrame) and f.context_id == first.context_id]
        assert not [f for f in after if isinstance(f, TTSStoppedFrame) and f.context_id == first.context_id]

        await p.send(TTSSpeakFrame("Still here."))  # the service keeps working after a barge-in
        stopped = await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        assert stopped.context_id != first.context_id
        assert audio_by_context([f for _, f in p.down.frames]).get(stopped.context_id)
    assert not errors(p.up.of_type(ErrorFrame))
    assert paced_engine.stats()["active_streams"] == 0


async def test_voice_update_takes_effect_on_the_next_utterance(hf_engine: OrpheusEngine):
    options = dict(seed=11, max_tokens=70)
    service = OrpheusTTSService(engine=hf_engine, settings=Settings(voice="tara", **options))
    down, up = await run(
        service,
        [
            TTSSpeakFrame("Hi there."),
            TTSUpdateSettingsFrame(delta=Settings(voice="leo")),
            TTSSpeakFrame("Hi there."),
        ],
    )
    tara = await engine_pcm(hf_engine, "Hi there.", voice="tara", **options)
    leo = await engine_pcm(hf_engine, "Hi there.", voice="leo", **options)
    assert tara != leo
    assert list(audio_by_context(down).values()) == [tara, leo]
    assert not errors(up)


@pytest.mark.parametrize(
    "delta", [Settings(voice="nobody"), Settings(top_p=0.0), Settings(model="some/other-model")], ids=str
)
async def test_invalid_settings_update_pushes_error_and_service_keeps_working(engine: OrpheusEngine, delta):
    service = OrpheusTTSService(engine=engine, settings=Settings(seed=5))
    down, up = await run(service, [TTSUpdateSettingsFrame(delta=delta), TTSSpeakFrame(TEXT)])
    [error] = errors(up)
    assert error.processor is service and "rejected" in error.error
    assert service.is_usable
    assert list(audio_by_context(down).values()) == [await engine_pcm(engine, TEXT, seed=5)]


def test_constructor_validates_voice_and_engine_arguments(engine: OrpheusEngine, synthetic_config: EngineConfig):
    with pytest.raises(ValueError, match="unknown voice"):
        OrpheusTTSService(engine=engine, settings=Settings(voice="nobody"))
    with pytest.raises(ValueError, match="either engine or engine_config"):
        OrpheusTTSService(engine=engine, engine_config=synthetic_config)


async def test_services_share_the_process_wide_engine(synthetic_config: EngineConfig):
    config = replace(synthetic_config, noise_seed=12345)  # a config (so an engine) no other test shares
    a, b = (OrpheusTTSService(engine_config=config) for _ in range(2))
    shared = OrpheusEngine.shared(config)
    assert a.engine is b.engine is shared
    try:
        results = await asyncio.gather(*(run(s, [TTSSpeakFrame(TEXT)]) for s in (a, b)))
        for down, up in results:
            assert len(audio_by_context(down)) == 1 and not errors(up)
        assert shared.stats()["streams_completed"] == 2
    finally:
        await shared.aclose()


async def test_engine_at_capacity_is_reported_and_other_calls_continue(synthetic_config: EngineConfig):
    config = replace(synthetic_config, max_streams=1, synthetic=SyntheticConfig(tokens_per_second=300.0))
    engine = OrpheusEngine(config)
    try:
        first, second = OrpheusTTSService(engine=engine), OrpheusTTSService(engine=engine)
        async with running_pipeline(first) as p1, running_pipeline(second) as p2:
            await p1.send(TTSSpeakFrame(LONG_TEXT))
            await p1.down.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))
            await p2.send(TTSSpeakFrame(TEXT))
            error = await p2.up.wait_for(lambda f: isinstance(f, ErrorFrame))
            assert "capacity" in error.error and error.processor is second
            await p1.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=30)
        assert not p1.up.of_type(ErrorFrame)
        assert engine.stats()["active_streams"] == 0
    finally:
        await engine.aclose()


async def test_closed_engine_is_reported_and_the_service_written_off(synthetic_config: EngineConfig):
    engine = OrpheusEngine(synthetic_config)
    await engine.aclose()
    service = OrpheusTTSService(engine=engine)
    down, up = await run(service, [TTSSpeakFrame(TEXT)])
    assert [e.processor for e in errors(up)] == [service]
    assert not service.is_usable and not audio_by_context(down)


def test_package_import_does_not_import_pipecat():
    code = (
        "import sys, orpheus_tts_plugin\n"
        "assert 'pipecat' not in sys.modules, 'pipecat imported eagerly'\n"
        "from orpheus_tts_plugin import OrpheusTTSService\n"
        "assert OrpheusTTSService.__module__ == 'orpheus_tts_plugin.pipecat'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
