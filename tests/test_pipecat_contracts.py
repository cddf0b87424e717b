"""OrpheusTTSService against the contracts Pipecat's own TTS tests check for any TTS service (issue 9, point 7).

Written here, not copied, from what pipecat-ai's tests/test_tts_frame_ordering.py,
tests/test_tts_zero_audio_contexts.py and tests/test_service_switcher.py check; run through real
pipelines on the engine, each with generation faster than decoding (unpaced) and slower (paced). Stalls,
slow loads and faults come from ControlledBackend events the test sets, never from timing luck.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest
from pipecat.frames.frames import (
    AggregatedTextFrame,
    DataFrame,
    ErrorFrame,
    Frame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    ManuallySwitchServiceFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.service_switcher import ServiceSwitcher, ServiceSwitcherStrategyFailover
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.tts_service import TTSService
from pipecat.utils.errors import ErrorCategory
from test_pipecat_service import (
    FIRST_CHUNK_TOKENS,
    LONG_TEXT,
    PACINGS,
    TEXT,
    Running,
    audio_by_context,
    closing_engine,
    controlled_engine,
    errors,
    paced,
    run,
    running_pipeline,
    wait_until,
)

from orpheus_tts_plugin import EngineConfig, EngineError, OrpheusEngine
from orpheus_tts_plugin.pipecat import OrpheusTTSService
from tests.stubs import GatedBackend

LONG_WAIT = 60.0  # generous: the machine is shared and slow
STOP_TIMEOUT = 0.5  # a short stop_frame_timeout_s, so that "later than the timeout" is quick to reach
HOLD = FIRST_CHUNK_TOKENS + 7  # a held request has delivered its first chunk, then stalls


# ------------------------------------------------------------------ frames
@dataclass
class Marker(DataFrame):
    """A frame sent after an utterance: it must come out after that utterance's group."""

    label: str = ""


# One letter per frame type whose order the contracts fix; everything else is left out of the shape.
LETTERS: dict[type, str] = {
    LLMFullResponseStartFrame: "L",
    AggregatedTextFrame: "A",
    TTSStartedFrame: "S",
    TTSAudioRawFrame: "a",
    TTSTextFrame: "T",
    TTSStoppedFrame: "E",
    LLMFullResponseEndFrame: "Z",
    Marker: "M",
}
CONTEXT_FRAMES = (TTSStartedFrame, TTSAudioRawFrame, TTSTextFrame, TTSStoppedFrame)
# A sentence spoken: its audio with one TTSTextFrame per word among it, each after the audio it ends in
# (word timestamps).
SPOKEN = r"a+T[aT]*"


def shape(frames: list[Frame]) -> str:
    """The frames as letters (LETTERS), one per frame, other types left out: e.g. `ASaaaTE`."""
    return "".join(LETTERS.get(type(f), "") for f in frames)


def assert_shape(frames: list[Frame], pattern: str) -> None:
    """The frames' shape matches `pattern` entirely."""
    got = shape(frames)
    assert re.fullmatch(pattern, got), f"shape {got!r} does not match {pattern!r}"


def groups(frames: list[Frame]) -> list[list[Frame]]:
    """The Started..Stopped groups: every context frame lies inside one, each group under one context id."""
    out: list[list[Frame]] = []
    current: list[Frame] | None = None
    for frame in (f for f in frames if isinstance(f, CONTEXT_FRAMES)):
        if isinstance(frame, TTSStartedFrame):
            assert current is None, "a group started inside another"
            current = []
        assert current is not None, f"{type(frame).__name__} outside any Started..Stopped group"
        current.append(frame)
        if isinstance(frame, TTSStoppedFrame):
            assert len({f.context_id for f in current}) == 1, "one group, several context ids"
            out.append(current)
            current = None
    assert current is None, "a group never stopped"
    assert len({g[0].context_id for g in out}) == len(out), "two groups share a context id"
    return out


def turn(*sentences: str) -> list[Frame]:
    """An LLM turn streaming `sentences`."""
    return [LLMFullResponseStartFrame(), *(LLMTextFrame(s) for s in sentences), LLMFullResponseEndFrame()]


def spoken_contexts(frames: list[Frame]) -> list[str]:
    """Context ids that carried audio, in order."""
    return [cid for cid, pcm in audio_by_context(frames).items() if pcm]


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module", params=sorted(PACINGS))
def pacing(request: pytest.FixtureRequest) -> str:
    """Each test runs with generation faster than decoding (unpaced) and slower (paced)."""
    return request.param


@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig, pacing: str):
    """A plain engine at the test's pacing."""
    yield from closing_engine(paced(synthetic_config, pacing))


@pytest.fixture
def config(synthetic_config: EngineConfig, pacing: str) -> EngineConfig:
    """The engine config at the test's pacing; a held request never runs into the queue timeout."""
    return replace(paced(synthetic_config, pacing), queue_timeout_s=LONG_WAIT)


# Two ways an engine is full: every stream slot taken, or the backend's batch taken for longer than
# queue_timeout_s. (config changes, ControlledBackend options)
OVERLOADS = {
    "at max_streams": ({"max_streams": 1}, {}),
    "queued past queue_timeout_s": ({"max_streams": 8, "queue_timeout_s": 0.3}, {"max_batch_size": 1}),
}


@asynccontextmanager
async def full_engine(
    config: EngineConfig, kind: str = "at max_streams"
) -> AsyncIterator[tuple[OrpheusEngine, Callable[[], Awaitable[None]]]]:
    """An engine that turns every new request away (`kind`: OVERLOADS) until `make_room()` is awaited."""
    changes, backend = OVERLOADS[kind]
    async with controlled_engine(replace(config, **changes), hold_after=HOLD, **backend) as engine:
        holder = engine.synthesize(LONG_TEXT)  # another call's stream, held after its first chunk
        await asyncio.wait_for(anext(holder), LONG_WAIT)

        async def make_room() -> None:
            engine.backend_control.release.set()
            await holder.aclose()  # the engine frees the slot on its own thread, a moment later
            await wait_until(lambda: engine.stats()["active_streams"] == 0, timeout=LONG_WAIT)

        try:
            yield engine, make_room
        finally:
            await make_room()


# ------------------------------------------------------------------ services
class BackupTTS(TTSService):
    """A second TTS for ServiceSwitcher tests: 20 ms of silence per sentence; records what it spoke."""

    def __init__(self) -> None:
        super().__init__(push_start_frame=True, push_stop_frames=True, sample_rate=24_000, name="backup")
        self.spoken: list[str] = []

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        self.spoken.append(text)
        yield TTSAudioRawFrame(b"\x00\x00" * 480, self.sample_rate, 1, context_id=context_id)


async def speak_and_wait(p: Running, texts: list[str]) -> None:
    """Speak each text and wait until its context has stopped (on whichever service is active)."""
    for text in texts:
        before = len(p.down.of_type(TTSStoppedFrame))
        await p.send(TTSSpeakFrame(text))
        await wait_until(lambda n=before: len(p.down.of_type(TTSStoppedFrame)) > n, timeout=LONG_WAIT)


# ------------------------------------------------------------------ frame ordering
async def test_each_utterance_is_one_group_of_started_audio_text_stopped_and_later_frames_wait_for_it(
    engine: OrpheusEngine,
):
    service = OrpheusTTSService(engine=engine)
    frames = [TTSSpeakFrame("Hello there."), Marker("1"), TTSSpeakFrame("How are you today?"), Marker("2")]
    down, up = await run(service, frames)
    assert_shape(down, rf"(AS{SPOKEN}EM){{2}}")
    assert len(groups(down)) == 2
    assert [m.label for m in down if isinstance(m, Marker)] == ["1", "2"]
    assert not errors(up)


async def test_an_llm_turn_is_one_group_and_the_next_turn_begins_after_it_ends(engine: OrpheusEngine):
    service = OrpheusTTSService(engine=engine)
    down, up = await run(service, [*turn("Hello there. ", "How are you?"), *turn("Fine, thanks. ", "Bye now.")])
    assert_shape(down, rf"(LAS{SPOKEN}A{SPOKEN}EZ){{2}}")  # the end of a turn after its last word and its Stopped
    assert len(groups(down)) == 2
    assert not errors(up)


async def test_first_audio_later_than_the_stop_frame_timeout_stays_inside_one_group(config: EngineConfig):
    async with controlled_engine(config, hold_after=0) as engine:
        service = OrpheusTTSService(engine=engine, stop_frame_timeout_s=STOP_TIMEOUT)
        async with running_pipeline(service) as p:
            await p.send(TTSSpeakFrame(TEXT))
            await p.down.wait_for(lambda f: isinstance(f, TTSStartedFrame))
            await asyncio.sleep(4 * STOP_TIMEOUT)  # the first token, held: no audio for 4 stop timeouts
            assert not p.down.of_type(TTSAudioRawFrame, TTSStoppedFrame)
            engine.backend_control.release.set()
            await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=LONG_WAIT)
    assert_shape(p.down.received(), rf"AS{SPOKEN}E")
    assert len(groups(p.down.received())) == 1
    assert not p.up.of_type(ErrorFrame)


# ------------------------------------------------------------------ start-up and readiness
async def test_a_slow_engine_load_neither_delays_the_pipeline_start_nor_splits_the_first_utterance(
    config: EngineConfig,
):
    async with controlled_engine(config, hold_load=True) as engine:
        service = OrpheusTTSService(engine=engine, stop_frame_timeout_s=STOP_TIMEOUT)
        ready = asyncio.Event()
        service.add_event_handler("on_engine_ready", lambda _service: ready.set())
        async with running_pipeline(service, start_timeout_secs=1.0) as p:
            assert engine.health()["status"] == "starting" and not service.engine_ready  # started while loading
            await p.send(TTSSpeakFrame(TEXT))
            await p.down.wait_for(lambda f: isinstance(f, TTSStartedFrame))
            await asyncio.sleep(3.0)  # the load, held, outlasts the start timeout and 6 stop timeouts
            assert not ready.is_set() and not p.down.of_type(TTSAudioRawFrame)
            engine.backend_control.load.set()
            await asyncio.wait_for(ready.wait(), LONG_WAIT)
            assert service.engine_ready
            await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=LONG_WAIT)
    assert not p.timeouts
    assert_shape(p.down.received(), rf"AS{SPOKEN}E")
    assert not p.up.of_type(ErrorFrame)


async def test_an_engine_started_before_the_pipeline_is_ready_as_the_pipeline_starts(engine: OrpheusEngine):
    await engine.start()  # what production does before building pipelines
    service = OrpheusTTSService(engine=engine)
    ready = asyncio.Event()
    service.add_event_handler("on_engine_ready", lambda _service: ready.set())
    async with running_pipeline(service) as p:
        assert service.engine_ready
        await asyncio.wait_for(ready.wait(), LONG_WAIT)
    assert not p.up.of_type(ErrorFrame)


async def test_a_failed_engine_load_is_reported_at_start_up_and_writes_the_service_off(config: EngineConfig):
    async with controlled_engine(config, load_error=OSError("no weights here")) as engine:
        service = OrpheusTTSService(engine=engine, stop_frame_timeout_s=LONG_WAIT)
        async with running_pipeline(service) as p:
            error = await p.up.wait_for(lambda f: isinstance(f, ErrorFrame), timeout=LONG_WAIT)
            assert "failed to load" in error.error and "no weights here" in error.error
            assert not service.is_usable and not service.engine_ready
            await p.send(TTSSpeakFrame(TEXT))  # not given to the engine, and its context still closes at once
            await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=LONG_WAIT / 2)
    assert len(p.up.of_type(ErrorFrame)) == 1


async def test_a_service_started_on_a_failed_engine_is_written_off_at_start_up(config: EngineConfig):
    async with controlled_engine(config) as engine:
        engine.backend_control.die.set()
        with pytest.raises(EngineError):
            _ = [chunk async for chunk in engine.synthesize(TEXT)]
        assert engine.health()["status"] == "failed"
        service = OrpheusTTSService(engine=engine)
        async with running_pipeline(service) as p:
            error = await p.up.wait_for(lambda f: isinstance(f, ErrorFrame), timeout=LONG_WAIT)
    assert "engine failed" in error.error and error.category is ErrorCategory.SERVER
    assert not service.is_usable


# ------------------------------------------------------------------ failed requests
async def already_full() -> None:
    """Nothing to do: a full engine turns the next request away as it is."""


@asynccontextmanager
async def failing_engine(
    config: EngineConfig, failure: str
) -> AsyncIterator[tuple[OrpheusEngine, Callable[[], Awaitable[None]]]]:
    """A started engine, and `fail()`: after it, the next request fails in the way `failure` names (FAILURES)."""
    if failure in OVERLOADS:
        async with full_engine(config, failure) as (engine, _):
            yield engine, already_full
        return
    async with controlled_engine(config) as engine:
        await engine.start()

        async def fail() -> None:
            if failure == "engine closed":
                await engine.aclose()
            else:
                engine.backend_control.die.set()  # the stepping thread dies at the request's first step

        yield engine, fail


# failure → the ErrorFrame's category. Each leaves the service unusable as it is reported: written off, or (an
# overload) until the engine has room.
FAILURES = {
    "at max_streams": ErrorCategory.RATE_LIMIT,
    "queued past queue_timeout_s": ErrorCategory.RATE_LIMIT,
    "engine closed": ErrorCategory.SERVER,
    "backend thread died": ErrorCategory.SERVER,
}


@pytest.mark.parametrize("failure", list(FAILURES))
async def test_a_failed_request_is_one_error_and_its_context_stops_right_after_it(config: EngineConfig, failure):
    async with failing_engine(config, failure) as (engine, fail):
        service = OrpheusTTSService(engine=engine, stop_frame_timeout_s=LONG_WAIT)
        usable_at_error: list[bool] = []
        service.add_event_handler("on_error", lambda s, _error: usable_at_error.append(s.is_usable))
        async with running_pipeline(service) as p:
            await fail()
            await p.send(TTSSpeakFrame(TEXT))
            error = await p.up.wait_for(lambda f: isinstance(f, ErrorFrame), timeout=LONG_WAIT)
            stopped = await p.down.wait_for(lambda f: isinstance(f, TTSStoppedFrame), timeout=LONG_WAIT / 2)
            assert 0 <= p.down.arrival(stopped) - p.up.arrival(error) < 10, "closed at once, not at the timeout"
    assert error.processor is service and error.category is FAILURES[failure] and usable_at_error == [False]
    assert_shape(p.down.received(), r"ASTE")  # no audio, the sentence's text inside the group
    assert len(groups(p.down.received())) == 1
    assert len(p.up.of_type(ErrorFrame)) == 1  # nothing added for a context with no audio


# ------------------------------------------------------------------ contexts with no audio
async def test_contexts_ending_with_no_audio_and_no_error_still_write_the_service_off_after_three(
    config: EngineConfig,
):
    async with controlled_engine(config, silent=True) as engine:
        service = OrpheusTTSService(engine=engine, stop_frame_timeout_s=LONG_WAIT)
        texts = ["One.", "Two.", "Three.", "Four."]
        down, up = await asyncio.wait_for(run(service, [TTSSpeakFrame(t) for t in texts]), LONG_WAIT / 2)
    found = [e.error for e in errors(up)]
    assert len(found) == 3 and "3 consecutive TTS contexts completed with no audio" in found[-1], found
    assert not service.is_usable
    assert_shape(down, r"(ASTE){4}")  # each silent context closed at once (the timeout is 60 s)


@pytest.mark.parametrize("kind", list(OVERLOADS))
async def test_overloads_never_write_the_service_off_it_is_usable_again_once_the_engine_has_room_and_speaks(
    config: EngineConfig, kind: str
):
    async with full_engine(config, kind) as (engine, make_room):
        service = OrpheusTTSService(engine=engine)
        async with running_pipeline(service) as p:
            await speak_and_wait(p, [f"Attempt number {i}." for i in range(5)])  # refused, or skipped while unusable
            await make_room()
            await wait_until(lambda: service.is_usable, timeout=LONG_WAIT)
            await speak_and_wait(p, [TEXT])
    found = p.up.of_type(ErrorFrame)
    assert 1 <= len(found) <= 5 and all(e.category is ErrorCategory.RATE_LIMIT for e in found)  # no "no audio" ones
    assert service.is_usable
    last = groups(p.down.received())[-1][0].context_id
    assert spoken_contexts(p.down.received()) == [last]


# ------------------------------------------------------------------ ServiceSwitcher
@asynccontextmanager
async def gated_engine(config: EngineConfig) -> AsyncIterator[OrpheusEngine]:
    """A one-stream engine on which a request mentioning "hold" stalls after its first chunk until `backend.gate`."""
    backend = GatedBackend(config.synthetic, after=HOLD)
    engine = OrpheusEngine(replace(config, max_streams=1), backend=backend)
    engine.backend_control = backend
    try:
        yield engine
    finally:
        backend.gate.set()
        await engine.aclose()


async def test_a_full_engine_fails_over_so_the_backup_speaks_every_utterance_and_the_primary_comes_back_with_room(
    config: EngineConfig,
):
    async with gated_engine(config) as engine:
        primary, backup = OrpheusTTSService(engine=engine), BackupTTS()
        switcher = ServiceSwitcher([primary, backup], strategy_type=ServiceSwitcherStrategyFailover)
        changes: list[bool] = []
        async with running_pipeline(switcher) as p:

            @primary.event_handler("on_usable_changed")
            async def switch_back(service: FrameProcessor, usable: bool) -> None:  # what an application does
                changes.append(usable)
                if usable:
                    await p.send(ManuallySwitchServiceFrame(service=service))

            await speak_and_wait(p, ["Hello there."])  # the primary, while the engine has room
            holder = engine.synthesize("Please hold. " + LONG_TEXT)  # another call takes the only stream
            first_chunk = asyncio.ensure_future(anext(holder))
            await wait_until(lambda: engine.load >= 1, timeout=LONG_WAIT)
            failover_s = await wait_until(lambda: switcher.strategy.active_service is backup, timeout=LONG_WAIT)
            attempts = [f"Attempt number {i}." for i in range(5)]
            await speak_and_wait(p, attempts)
            await asyncio.wait_for(first_chunk, LONG_WAIT)
            engine.backend_control.gate.set()
            await holder.aclose()  # the other call hangs up
            recovery_s = await wait_until(lambda: switcher.strategy.active_service is primary, timeout=LONG_WAIT)
            await speak_and_wait(p, [TEXT])
    print(f"failover {failover_s * 1000:.0f} ms after the engine filled, back {recovery_s * 1000:.0f} ms after room")
    assert backup.spoken == attempts  # every utterance while the engine was full, none lost
    assert changes == [False, True] and primary.is_usable
    assert not p.up.of_type(ErrorFrame)  # the failover absorbed the overload
    primary_audio = [pcm for pcm in audio_by_context(p.down.received()).values() if len(pcm) > 960]
    assert len(primary_audio) == 2  # the first and the last utterance
    assert failover_s < 5 and recovery_s < 5


async def test_an_utterance_refused_where_the_load_does_not_show_it_fails_over_at_once(config: EngineConfig):
    async with full_engine(config, "queued past queue_timeout_s") as (engine, make_room):
        assert engine.load < 1  # the backend's batch is full, not the engine's streams
        primary, backup = OrpheusTTSService(engine=engine), BackupTTS()
        switcher = ServiceSwitcher([primary, backup], strategy_type=ServiceSwitcherStrategyFailover)
        async with running_pipeline(switcher) as p:
            attempts = [f"Attempt number {i}." for i in range(3)]
            await speak_and_wait(p, attempts)  # the first waits queue_timeout_s and is refused: the switch
            await wait_until(lambda: primary.is_usable, timeout=LONG_WAIT)  # back at the next check of the load
    assert switcher.strategy.active_service is backup  # the application decides when to switch back
    assert backup.spoken == attempts[1:]
    assert not p.up.of_type(ErrorFrame)


async def test_with_unusable_while_overloaded_off_overloads_never_fail_over_and_the_primary_speaks_again(config):
    async with full_engine(config) as (engine, make_room):
        primary, backup = OrpheusTTSService(engine=engine, unusable_while_overloaded=False), BackupTTS()
        switcher = ServiceSwitcher([primary, backup], strategy_type=ServiceSwitcherStrategyFailover)
        async with running_pipeline(switcher) as p:
            await speak_and_wait(p, [f"Attempt number {i}." for i in range(5)])
            assert switcher.strategy.active_service is primary and primary.is_usable
            await make_room()
            await speak_and_wait(p, [TEXT])
    assert backup.spoken == []
    assert [e.processor for e in p.up.of_type(ErrorFrame)] == [primary] * 5
    assert len(spoken_contexts(p.down.received())) == 1  # the primary, once the engine had room


async def test_a_dead_engine_fails_over_to_the_backup_for_the_rest_of_the_call(config: EngineConfig):
    async with failing_engine(config, "backend thread died") as (engine, fail):
        await fail()
        primary, backup = OrpheusTTSService(engine=engine), BackupTTS()
        switcher = ServiceSwitcher([primary, backup], strategy_type=ServiceSwitcherStrategyFailover)
        async with running_pipeline(switcher) as p:
            await speak_and_wait(p, ["Hello there.", "Are you still there?", "Goodbye."])
    assert switcher.strategy.active_service is backup and not primary.is_usable and switcher.is_usable
    assert backup.spoken == ["Are you still there?", "Goodbye."]
    assert not p.up.of_type(ErrorFrame)  # the switcher recovered on its own
