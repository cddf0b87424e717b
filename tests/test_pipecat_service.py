"""OrpheusTTSService through real Pipecat pipelines: frames, rates, metrics, settings, interruption, sharing.

Also the harness the other Pipecat test files use: recorders, a running pipeline, engines with generation
faster than decoding (unpaced) and slower (paced), and a synthetic backend whose stalls the test controls.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import soxr
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMRunFrame,
    LLMTextFrame,
    MetricsFrame,
    OutputAudioRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
    VADUserStartedSpeakingFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import run_test
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.turns.user_start.vad_user_turn_start_strategy import VADUserTurnStartStrategy
from pipecat.turns.user_stop.speech_timeout_user_turn_stop_strategy import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.backends.protocol import GenerationRequest
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.pipecat import OrpheusTTSService
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.words import Pace, Span, WordTimer

Settings = OrpheusTTSService.Settings
TEXT = "Hello there, thanks for calling the test line today."
LONG_TEXT = (
    "Thanks for calling. Our opening hours are nine to five on weekdays and ten to four on Saturdays, "
    "and we are closed on Sundays and public holidays, so please call back then if you need anything else."
)
# Tokens per second per stream: 0 = as fast as the backend thread steps (generation runs ahead of decoding, as
# on a GPU); 300 = about 3.6x real time, slower than the tiny SNAC decodes (each frame decoded as it comes).
PACINGS = {"unpaced": 0.0, "paced": 300.0}
# A stream's audio equals the same text spoken alone within 2 int16 steps (issue 9, point 1): the exact bytes
# depend on how frames fall into decoder calls, and that depends on the relative speed of generation and decoding.
AUDIO_TOLERANCE = 2
FIRST_CHUNK_TOKENS = 28  # 4 frames of 7 tokens: what the engine needs before it emits the first chunk


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

    def received(self) -> list[Frame]:
        return [f for _, f in self.frames]

    def arrival(self, frame: Frame) -> float:
        """When `frame` was recorded (time.monotonic())."""
        return next(t for t, f in self.frames if f is frame)

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
    """A running pipeline [upstream recorder, service, downstream recorder]; `timeouts`: on_pipeline_timeout frames."""

    worker: PipelineWorker
    down: Recorder
    up: Recorder
    timeouts: list[Frame]

    async def send(self, *frames: Frame) -> None:
        await self.worker.queue_frames(frames)


@asynccontextmanager
async def running_pipeline(
    processor: FrameProcessor, params: PipelineParams | None = None, **worker_options: Any
) -> AsyncIterator[Running]:
    """Run `processor` in a PipelineWorker for the block, then end it with an EndFrame (which drains audio)."""
    up, down = Recorder(FrameDirection.UPSTREAM), Recorder(FrameDirection.DOWNSTREAM)
    pipeline = Pipeline([up, processor, down])
    worker = PipelineWorker(pipeline, params=params or PipelineParams(), cancel_on_idle_timeout=False, **worker_options)
    timeouts: list[Frame] = []
    worker.add_event_handler("on_pipeline_timeout", lambda _worker, frame: timeouts.append(frame))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    task = asyncio.create_task(runner.run())
    try:
        await down.wait_for(lambda f: isinstance(f, StartFrame), timeout=60)
        yield Running(worker, down, up, timeouts)
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
    """`run_test` with a generous start timeout (the machine is shared and slow)."""
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


def max_difference(a: bytes, b: bytes) -> int:
    """The largest sample difference between two int16 PCM buffers of the same length."""
    x, y = (np.frombuffer(pcm, dtype="<i2").astype(np.int32) for pcm in (a, b))
    assert x.size == y.size, f"{x.size} samples against {y.size}"
    return int(np.abs(x - y).max(initial=0))


def assert_audio_matches(got: bytes, reference: bytes) -> None:
    """Same number of samples, every sample within AUDIO_TOLERANCE of the reference."""
    assert got and max_difference(got, reference) <= AUDIO_TOLERANCE


def paced(config: EngineConfig, pacing: str) -> EngineConfig:
    """`config` with the synthetic backend at one of PACINGS."""
    return replace(config, synthetic=replace(config.synthetic, tokens_per_second=PACINGS[pacing]))


class ThreadDeath(BaseException):
    """Raised in the backend's stepping thread to kill it (a BaseException: nothing in the thread catches it)."""


class ControlledBackend(SyntheticBackend):
    """Synthetic tokens with stalls and faults the test controls through events.

    `load` gates the model load (cleared: the engine's start waits); `release` gates generation
    (cleared: each request stops after `hold_after` ids until it is set); `die` kills the stepping
    thread at its next step; `load_error`, if given, is raised by the load; `silent`: every request
    ends at once, with no audio and no error (a model that stopped speaking).
    """

    def __init__(
        self,
        config: SyntheticConfig,
        *,
        hold_after: int | None = None,
        hold_load: bool = False,
        load_error: Exception | None = None,
        silent: bool = False,
        max_batch_size: int = 1024,
    ):
        super().__init__(config, max_batch_size=max_batch_size)
        self.hold_after = hold_after or 0
        self.load, self.release, self.die = threading.Event(), threading.Event(), threading.Event()
        if not hold_load:
            self.load.set()
        if hold_after is None:
            self.release.set()
        self.load_error = load_error
        self.silent = silent

    def open_gates(self) -> None:
        """Let everything through (teardown: no thread may stay blocked)."""
        self.load.set()
        self.release.set()

    def _load(self) -> None:
        self.load.wait(120)
        if self.load_error is not None:
            raise self.load_error

    def _admit(self, req: GenerationRequest) -> dict[str, Any]:
        state = super()._admit(req)
        if self.silent:
            state["ids"] = [self.spec.end_of_speech]
        return state

    def _step(self, states: list[dict[str, Any]]) -> list[tuple[list[int], str | None]]:
        if self.die.is_set():
            raise ThreadDeath("injected: the stepping thread dies")
        if self.release.is_set():
            return super()._step(states)
        moving = [st["i"] < self.hold_after for st in states]
        if not any(moving):
            self.release.wait(0.01)  # every request is held: idle instead of spinning
            return [([], None)] * len(states)
        stepped = iter(super()._step([st for st, m in zip(states, moving, strict=True) if m]))
        return [next(stepped) if m else ([], None) for m in moving]


@asynccontextmanager
async def controlled_engine(config: EngineConfig, **backend_options: Any) -> AsyncIterator[OrpheusEngine]:
    """An engine on a ControlledBackend (as `engine.backend_control`), closed at the end of the block."""
    backend = ControlledBackend(config.synthetic, **backend_options)
    engine = OrpheusEngine(config, backend=backend)
    engine.backend_control = backend
    try:
        yield engine
    finally:
        backend.open_gates()
        await engine.aclose()


# ------------------------------------------------------------------ engines
def closing_engine(config: EngineConfig):
    """A module fixture's body: an engine of `config`, closed at teardown."""
    engine = OrpheusEngine(config)
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module", params=sorted(PACINGS))
def pacing(request: pytest.FixtureRequest) -> str:
    """Each engine-behaviour test runs with generation faster than decoding (unpaced) and slower (paced)."""
    return request.param


@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig, pacing: str):
    """Synthetic tokens at the test's pacing, the real streaming decoder on the tiny SNAC."""
    yield from closing_engine(paced(synthetic_config, pacing))


@pytest.fixture
async def held_engine(synthetic_config: EngineConfig, pacing: str) -> AsyncIterator[OrpheusEngine]:
    """Each request stops after 10 frames until `engine.backend_control.release` is set: still generating when cut."""
    async with controlled_engine(paced(synthetic_config, pacing), hold_after=70) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_engine(hf_config: EngineConfig):
    """The full stack on the tiny random Llama: the prompt (voice, text) changes the audio."""
    yield from closing_engine(hf_config)


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
        assert_audio_matches(got.tobytes(), reference.tobytes())  # the engine's audio, nothing added or lost
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
    assert [f.text for f in down if isinstance(f, TTSTextFrame)] == "Hello there. How are you today? Fine".split()
    assert len([f for f in down if isinstance(f, TTSStartedFrame)]) == 1
    assert len([f for f in down if isinstance(f, TTSStoppedFrame)]) == 1
    assert len(audio_by_context(down)) == 1
    assert engine.stats()["utterances"] - before == 3  # one engine request per aggregated sentence
    assert not errors(up)


async def test_interruption_aborts_the_engine_request_and_no_audio_of_that_context_follows(
    held_engine: OrpheusEngine,
):
    service = OrpheusTTSService(engine=held_engine)
    async with running_pipeline(service) as p:
        await p.send(TTSSpeakFrame(LONG_TEXT))
        first = await p.down.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))
        assert held_engine.stats()["active_streams"] == 1  # held after 10 frames: certainly still generating

        await p.send(InterruptionFrame())
        interruption = await p.down.wait_for(lambda f: isinstance(f, InterruptionFrame))
        await wait_until(lambda: held_engine.stats()["active_streams"] == 0, timeout=5.0)
        assert held_engine.stats()["streams_cancelled"] == 1
        await asyncio.sleep(0.5)  # audio still in flight anywhere would arrive now

        frames = [f for _, f in p.down.frames]
        after = frames[frames.index(interruption) :]
        assert not [f for f in after if isinstance(f, TTSAudioRawFrame) and f.context_id == first.context_id]
        assert not [f for f in after if isinstance(f, TTSStoppedFrame) and f.context_id == first.context_id]

        held_engine.backend_control.release.set()
        await p.send(TTSSpeakFrame("Still here."))  # the service keeps working after a barge-in
        stopped = await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        assert stopped.context_id != first.context_id
        assert audio_by_context([f for _, f in p.down.frames]).get(stopped.context_id)
    assert not errors(p.up.of_type(ErrorFrame))
    assert held_engine.stats()["active_streams"] == 0


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
    assert len(tara) != len(leo) or max_difference(tara, leo) > 100 * AUDIO_TOLERANCE  # voices far apart
    # Within the tolerance, not byte for byte: the bytes depend on how frames fell into decoder calls, which
    # follows the machine's load (a decoder slowed by 50 ms a call moved both utterances by 1 step).
    spoken = list(audio_by_context(down).values())
    assert len(spoken) == 2
    assert_audio_matches(spoken[0], tara)
    assert_audio_matches(spoken[1], leo)
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
    [spoken] = audio_by_context(down).values()
    assert_audio_matches(spoken, await engine_pcm(engine, TEXT, seed=5))


def test_constructor_validates_voice_and_engine_arguments(synthetic_config: EngineConfig):
    engine = OrpheusEngine(synthetic_config)  # never started: validation needs no model
    with pytest.raises(ValueError, match="unknown voice"):
        OrpheusTTSService(engine=engine, settings=Settings(voice="nobody"))
    with pytest.raises(ValueError, match="either engine or engine_config"):
        OrpheusTTSService(engine=engine, engine_config=synthetic_config)
    with pytest.raises(ValueError, match="capacity_poll_s"):
        OrpheusTTSService(engine=engine, capacity_poll_s=0)


async def test_services_share_the_process_wide_engine(synthetic_config: EngineConfig, pacing: str):
    config = replace(paced(synthetic_config, pacing), noise_seed=12345)  # a config (so an engine) no other test shares
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


async def test_a_full_engine_is_reported_the_others_unusable_until_it_has_room_and_the_speaking_call_continues(
    synthetic_config: EngineConfig, pacing: str
):
    config = replace(paced(synthetic_config, pacing), max_streams=1)
    async with controlled_engine(config, hold_after=70) as engine:
        first, second = OrpheusTTSService(engine=engine), OrpheusTTSService(engine=engine)
        async with running_pipeline(first) as p1, running_pipeline(second) as p2:
            await p1.send(TTSSpeakFrame(LONG_TEXT))
            await p1.down.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))  # held: the only slot stays taken
            await p2.send(TTSSpeakFrame(TEXT))
            error = await p2.up.wait_for(lambda f: isinstance(f, ErrorFrame))
            assert "capacity" in error.error and error.processor is second and not second.is_usable
            await p2.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame))  # its context closed, not left open
            assert first.is_usable  # speaking: its next sentence takes the slot its current one frees
            engine.backend_control.release.set()
            await p1.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=60)
            await wait_until(lambda: second.is_usable, timeout=60)  # the engine has room again
        assert not p1.up.of_type(ErrorFrame) and len(p2.up.of_type(ErrorFrame)) == 1
        assert engine.stats()["active_streams"] == 0


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


# ------------------------------------------------------------------ word timestamps
# One sentence (Pipecat's aggregator passes it whole), long enough that its words outlast the held audio.
REPLY = (
    "Our opening hours are nine to five on weekdays and ten to four on Saturdays, and we are closed on "
    "Sundays and public holidays, so please call back on a weekday if you need anything else from us."
)
REPLY_HOLD = 330  # tokens before the reply's request stalls: 47 frames, about 4 s of audio
# Tokens a second a stream: generation ahead of playback (unpaced, 300/s) and behind it (60/s is 0.73x real
# time: the speaker runs dry between chunks, and every later word must move with the audio).
PLAYBACK_SPEEDS = {**PACINGS, "slower-than-playback": 60.0}
STALL_AT = 7 * 18  # tokens before a request stalls in the stall test: 18 frames, about 1.4 s of audio


DEVICE_BUFFER_S = 0.1


class Speaker(BaseOutputTransport):
    """An audio device at the end of the pipeline: plays each chunk in real time after the one before it.

    `played(at)` is how much audio has been heard by `at` (time.monotonic()); `interrupted_at` when the
    first InterruptionFrame reached the device.
    """

    def __init__(self) -> None:
        super().__init__(TransportParams(audio_out_enabled=True))
        self._plays: list[tuple[float, float]] = []  # (start, seconds) of each chunk
        self._until = 0.0
        self.interrupted_at: float | None = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        if isinstance(frame, InterruptionFrame) and self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
        await super().process_frame(frame, direction)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        now = time.monotonic()
        start = max(now, self._until)
        seconds = len(frame.audio) / 2 / frame.sample_rate
        self._plays.append((start, seconds))
        self._until = start + seconds
        # A device buffer of DEVICE_BUFFER_S: the write returns that long before the chunk before it ends, as a
        # sound card takes the next period while one plays; so a late wake-up of this (test) event loop is not
        # heard as a gap, and only audio that comes too late for the device (a stall in generation) is.
        await asyncio.sleep(max(0.0, start - now - DEVICE_BUFFER_S))
        return True

    def played(self, at: float | None = None) -> float:
        at = time.monotonic() if at is None else at
        return sum(min(max(at - start, 0.0), seconds) for start, seconds in self._plays)


class ScriptedLLM(FrameProcessor):
    """In place of the LLM: answers every context with `reply`, streamed a word at a time."""

    def __init__(self, reply: str):
        super().__init__()
        self.reply = reply

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMContextFrame):
            await self.push_frame(frame, direction)
            return
        await self.push_frame(LLMFullResponseStartFrame())
        for token in re.findall(r"\S+\s*", self.reply):
            await self.push_frame(LLMTextFrame(token))
        await self.push_frame(LLMFullResponseEndFrame())


@pytest.fixture(params=sorted(PLAYBACK_SPEEDS))
async def replying_engine(
    synthetic_config: EngineConfig, request: pytest.FixtureRequest
) -> AsyncIterator[OrpheusEngine]:
    """Each request stalls after REPLY_HOLD tokens (still generating when cut), at each PLAYBACK_SPEEDS rate."""
    config = replace(
        synthetic_config,
        synthetic=replace(synthetic_config.synthetic, tokens_per_second=PLAYBACK_SPEEDS[request.param]),
    )
    async with controlled_engine(config, hold_after=REPLY_HOLD) as engine:
        yield engine


async def test_each_word_is_one_text_frame_with_a_pts_in_order_and_a_tag_is_no_word(engine: OrpheusEngine):
    service = OrpheusTTSService(engine=engine)
    text = "Well <laugh> hello there, how are you today?"
    down, up = await run(service, [TTSSpeakFrame(text)])
    words = [f for f in down if isinstance(f, TTSTextFrame)]
    assert [f.text for f in words] == "Well hello there, how are you today?".split()
    assert all(f.pts for f in words)
    assert [f.pts for f in words] == sorted(f.pts for f in words)
    stopped = next(f for f in down if isinstance(f, TTSStoppedFrame))
    assert stopped.pts == words[-1].pts  # the base class sends the end after the last word
    assert not errors(up)


async def speak_and_interrupt(
    engine: OrpheusEngine, before_interrupting: Callable[[Speaker], Awaitable[None]]
) -> tuple[list[str], list[str]]:
    """REPLY through user aggregator → LLM → TTS → speaker → assistant aggregator, cut off by the caller.

    Awaits `before_interrupting(speaker)`, then the caller starts talking over the bot. Returns the words
    of the assistant message the interruption left, and the words whose audio the speaker had played by
    then, where the estimator placed them: the speaking-rate prior's plan (positions in the audio, which
    neither delivery nor playback timing changes; the words of interest are all given before the end).
    """
    context = LLMContext([{"role": "user", "content": "When are you open?"}])
    strategies = UserTurnStrategies(start=[VADUserTurnStartStrategy()], stop=[SpeechTimeoutUserTurnStopStrategy()])
    pair = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(user_turn_strategies=strategies))
    speaker = Speaker()
    pipeline = Pipeline([pair.user(), ScriptedLLM(REPLY), OrpheusTTSService(engine=engine), speaker, pair.assistant()])
    async with running_pipeline(pipeline, PipelineParams(audio_out_sample_rate=SAMPLE_RATE)) as p:
        await p.send(LLMRunFrame())
        await before_interrupting(speaker)
        await p.send(VADUserStartedSpeakingFrame())  # the user aggregator's turn start interrupts the bot
        await wait_until(lambda: any(m["role"] == "assistant" for m in context.get_messages()), timeout=10)
    assert speaker.interrupted_at is not None
    played = speaker.played(speaker.interrupted_at)
    [message] = [m["content"] for m in context.get_messages() if m["role"] == "assistant"]
    planned = WordTimer([REPLY], Pace()).feed(Span(0, 60 * SAMPLE_RATE))
    said = message.split()
    assert said == REPLY.split()[: len(said)], message  # the reply's own words, in order
    return said, [w.text for w in planned if w.start_s <= played]


async def test_an_interruption_mid_sentence_leaves_the_assistant_message_holding_the_words_played(
    replying_engine: OrpheusEngine,
):
    async def two_seconds_played(speaker: Speaker) -> None:
        await wait_until(lambda: speaker.played() >= 2.0, timeout=60)  # mid-sentence: its audio stalls at ~4 s

    said, played = await speak_and_interrupt(replying_engine, two_seconds_played)
    assert len(played) >= 5 and abs(len(said) - len(played)) <= 1, (said, played)
    assert replying_engine.stats()["active_streams"] == 0


async def test_after_a_stall_in_generation_the_words_still_wait_for_their_audio(
    synthetic_config: EngineConfig, pacing: str
):
    async with controlled_engine(paced(synthetic_config, pacing), hold_after=STALL_AT) as engine:

        async def stall_then_resume(speaker: Speaker) -> None:
            await wait_until(lambda: speaker.played() >= 1.0, timeout=60)
            await asyncio.sleep(1.5)  # the request stalls after ~1.4 s of audio: the speaker runs dry for > 1 s
            resumed_at = speaker.played()
            engine.backend_control.release.set()  # then it races ahead of playback again
            await wait_until(lambda: speaker.played() >= resumed_at + 1.0, timeout=60)

        said, played = await speak_and_interrupt(engine, stall_then_resume)
    assert len(played) >= 5 and abs(len(said) - len(played)) <= 1, (said, played)
