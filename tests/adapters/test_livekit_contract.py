"""LiveKit's TTS contract, kept by the Orpheus TTS: real livekit-agents classes, real engines, no LiveKit server.

Written here (not copied) after what livekit-agents' own tests/test_tts.py and tests/test_tts_fallback.py
check of any TTS: `conn_options.timeout` bounds the wait for the first audio and between chunks
(`APITimeoutError`, and the engine request is aborted); LiveKit's retries (a `synthesize()` retry after
partial audio starts over under a fresh request id, a stream that already spoke is not retried);
`tts.FallbackAdapter` failing over on a stall, an overload and an engine that cannot serve (closed,
failed, weights missing), then recovering through its probes; `tts.StreamAdapter` around Orpheus;
cancellation, admission, many event loops and the worker's load report.

Every test runs twice: generation faster than decoding (unpaced synthetic tokens) and slower (paced at
300 tokens/s a stream). Stalls and deaths come from a backend the test controls with events, never from
sleeps; timeouts are generous where audio must flow within them.

Run as a script, this file measures the FallbackAdapter's failover time (docs/livekit.md):
`.venv/bin/python tests/adapters/test_livekit_contract.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import statistics
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from livekit.agents import (
    AgentServer,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
)
from livekit.agents.tts import TTS, AvailabilityChangedEvent, FallbackAdapter, StreamAdapter, SynthesizedAudio, TTSError

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.errors import EngineError

ONE = "This single sentence is long enough to make a few dozen frames of audio."
SENTENCES = ("Once upon a time there was a tiny model.", "It spoke in random noise.", "Everyone listened anyway.")
STORY = " ".join(SENTENCES)
SEED = 7
STALL_AFTER = 42  # tokens: 6 frames, so the first chunk (4 frames) and two more are out before a stall
NO_AUDIO_TIMEOUT = 0.5  # where no audio can come at all, the wait always ends by the timeout
FLOW_TIMEOUT = 2.0  # where healthy audio must come within the timeout, on a slow shared machine
PACES = {"fast-generation": 0.0, "paced-generation": 300.0}


def _synthetic(pace: float) -> SyntheticConfig:
    """Tokens at `pace` a second per stream (0: as fast as they can be made), utterances a third the usual length."""
    return SyntheticConfig(tokens_per_second=pace, frames_per_prompt_token=0.5)


def _paced(config: EngineConfig, pace: float) -> EngineConfig:
    return replace(config, synthetic=_synthetic(pace))


class _ThreadDeath(BaseException):
    """Escapes every `except Exception`: what kills the backend's stepping thread."""


class ControlledBackend(SyntheticBackend):
    """Synthetic tokens that a test holds back and resumes with events, or whose stepping thread it kills.

    While `stalling` is set, each request stops after `stall_after` tokens: it stays live with no
    more tokens and no finish, as a hung model would, and `stalled` is set. Clearing `stalling`
    resumes every held request where it stopped. Setting `dying` kills the thread at its next step.
    """

    def __init__(self, tokens_per_second: float, stall_after: int = 0) -> None:
        super().__init__(_synthetic(tokens_per_second))
        self.stall_after = stall_after
        self.stalling = threading.Event()
        self.stalled = threading.Event()
        self.dying = threading.Event()

    def _step(self, states: list[dict[str, Any]]) -> list[tuple[list[int], str | None]]:
        if self.dying.is_set():
            raise _ThreadDeath("killed by the test")
        held = [self.stalling.is_set() and st["i"] >= self.stall_after for st in states]
        if any(held):
            self.stalled.set()
        moving = [st for st, h in zip(states, held) if not h]
        if not moving:
            time.sleep(0.002)  # every request is held: step again soon, without spinning
            return [([], None)] * len(states)
        outs = iter(super()._step(moving))
        return [([], None) if h else next(outs) for h in held]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=list(PACES.values()), ids=list(PACES))
def pace(request: pytest.FixtureRequest) -> float:
    """Synthetic tokens a second per stream: 0 runs generation ahead of decoding, as on a GPU."""
    return request.param


@pytest.fixture(scope="module")
def backup(synthetic_config: EngineConfig, pace: float) -> Iterator[OrpheusEngine]:
    """A healthy engine: the TTS a FallbackAdapter fails over to, and the reference audio."""
    engine = OrpheusEngine(_paced(synthetic_config, pace))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@contextlib.asynccontextmanager
async def controlled(
    config: EngineConfig, pace: float, *, stall_after: int = 0, stalling: bool = False, **overrides: Any
) -> AsyncIterator[tuple[OrpheusEngine, ControlledBackend]]:
    """A started engine on a ControlledBackend, closed on exit; its own queue timeout out of the way unless given."""
    backend = ControlledBackend(pace, stall_after)
    if stalling:
        backend.stalling.set()
    engine = OrpheusEngine(replace(config, **{"queue_timeout_s": 60.0, **overrides}), backend=backend)
    await engine.start()
    try:
        yield engine, backend
    finally:
        backend.stalling.clear()
        await engine.aclose()


# ---------------------------------------------------------------------------------------------- helpers
def _options(timeout: float, max_retry: int = 0, retry_interval: float = 0.0) -> APIConnectOptions:
    return APIConnectOptions(max_retry=max_retry, timeout=timeout, retry_interval=retry_interval)


def _request(tts: TTS, kind: str, text: str, conn_options: APIConnectOptions) -> Any:
    """One request: `synthesize(text)`, or `stream()` with the text pushed and the input ended."""
    if kind == "synthesize":
        return tts.synthesize(text, conn_options=conn_options)
    stream = tts.stream(conn_options=conn_options)
    stream.push_text(text)
    stream.end_input()
    return stream


async def _collect(stream: Any, timeout: float = 60.0) -> tuple[list[SynthesizedAudio], Exception | None]:
    """A request's events up to its end or its error; fails instead of hanging."""
    events: list[SynthesizedAudio] = []

    async def drain() -> None:
        async for ev in stream:
            events.append(ev)

    try:
        async with stream:
            await asyncio.wait_for(drain(), timeout)
    except APIError as exc:
        return events, exc
    except asyncio.TimeoutError:
        raise AssertionError(f"the request neither ended nor failed in {timeout} s") from None
    return events, None


def _pcm(events: list[SynthesizedAudio]) -> np.ndarray:
    return np.frombuffer(b"".join(ev.frame.data.tobytes() for ev in events), dtype="<i2")


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Same audio up to float rounding (the decoder's batching and chunking vary from run to run)."""
    return a.size == b.size and np.abs(a.astype(int) - b).max() <= 2


async def _reference(engine: OrpheusEngine, text: str) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(text, seed=SEED)]), "<i2")


def _errors(tts: TTS) -> list[TTSError]:
    errors: list[TTSError] = []
    tts.on("error", errors.append)
    return errors


def _idle(engine: OrpheusEngine) -> bool:
    stats = engine.stats()
    return stats["active_streams"] == 0 and stats["backend"]["live_requests"] == 0


def _count(engine: OrpheusEngine, key: str) -> int:
    return engine.stats().get(key, 0)


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def _stalled(backend: ControlledBackend) -> None:
    assert await asyncio.to_thread(backend.stalled.wait, 10), "no request reached the stall"


@contextlib.asynccontextmanager
async def _held(engine: OrpheusEngine, backend: ControlledBackend) -> AsyncIterator[None]:
    """One engine stream taken and held at the stall (`stalling` set) for the duration of the block."""
    active = engine.stats()["active_streams"]
    stream = orpheus.TTS(engine=engine).synthesize(STORY, conn_options=_options(600.0))
    holding = asyncio.ensure_future(_collect(stream, timeout=600.0))
    await _stalled(backend)
    try:
        yield
    finally:
        await stream.aclose()
        await holding
        await _until(lambda: engine.stats()["active_streams"] == active)  # the engine frees the stream on its loop


async def _kill(engine: OrpheusEngine, backend: ControlledBackend) -> None:
    """Kill the backend's stepping thread with a sacrificial request; the engine then reports itself failed."""
    backend.dying.set()
    with pytest.raises(EngineError):
        async for _ in engine.synthesize("Goodbye."):
            pass
    await _until(lambda: engine.health()["status"] == "failed")


@contextlib.asynccontextmanager
async def _unserving(fault: str, config: EngineConfig, pace: float) -> AsyncIterator[OrpheusEngine]:
    """An engine that cannot serve: closed, failed (its backend thread killed), or unloadable (weights missing)."""
    if fault == "weights missing":
        engine = OrpheusEngine(replace(_paced(config, pace), snac="/nonexistent/snac"))
        try:
            yield engine
        finally:
            await engine.aclose()
        return
    async with controlled(config, pace) as (engine, backend):
        await (engine.aclose() if fault == "closed" else _kill(engine, backend))
        yield engine


# ---------------------------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_no_first_audio_within_the_timeout_raises_api_timeout_error_and_aborts_the_request(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stalling=True) as (engine, _):
        start = time.monotonic()
        events, error = await _collect(_request(orpheus.TTS(engine=engine), kind, ONE, _options(NO_AUDIO_TIMEOUT)))
        assert isinstance(error, APITimeoutError) and error.retryable
        assert events == [] and time.monotonic() - start >= NO_AUDIO_TIMEOUT
        await _until(lambda: _idle(engine), timeout=2.0)  # the backend dropped the request
        assert _count(engine, "streams_cancelled") == 1


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_a_gap_between_chunks_longer_than_the_timeout_raises_api_timeout_error_and_aborts_the_request(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, _):
        events, error = await _collect(_request(orpheus.TTS(engine=engine), kind, ONE, _options(FLOW_TIMEOUT)))
        assert isinstance(error, APITimeoutError) and error.retryable
        assert _pcm(events).size > 0  # audio came first: it was the gap after it that timed out
        await _until(lambda: _idle(engine), timeout=2.0)
        assert _count(engine, "streams_cancelled") == 1 and _count(engine, "streams_completed") == 0


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_audio_that_keeps_coming_within_the_timeout_is_never_cut(
    backup: OrpheusEngine, pace: float, kind: str
) -> None:
    text = f"{STORY} {STORY}"
    start = time.monotonic()
    events, error = await _collect(_request(orpheus.TTS(engine=backup, seed=SEED), kind, text, _options(FLOW_TIMEOUT)))
    assert error is None and events[-1].is_final
    if pace:  # paced tokens take longer than the timeout in all: the timeout bounds gaps, not the request
        assert time.monotonic() - start > FLOW_TIMEOUT
    if kind == "synthesize":
        assert _close(_pcm(events), await _reference(backup, text))


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_each_timed_out_attempt_is_retried_up_to_max_retry_and_only_the_last_error_is_final(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stalling=True) as (engine, _):
        tts = orpheus.TTS(engine=engine)
        errors = _errors(tts)
        start = time.monotonic()
        _, error = await _collect(_request(tts, kind, ONE, _options(NO_AUDIO_TIMEOUT, max_retry=2)))
        assert isinstance(error, APITimeoutError)
        assert [e.recoverable for e in errors] == [True, True, False]
        assert time.monotonic() - start >= 3 * NO_AUDIO_TIMEOUT
        await _until(lambda: _idle(engine), timeout=2.0)
        assert _count(engine, "streams_started") == _count(engine, "streams_cancelled") == 3  # each attempt aborted


async def test_a_synthesize_retry_after_partial_audio_speaks_the_whole_text_again_under_a_fresh_request_id(
    synthetic_config: EngineConfig, backup: OrpheusEngine, pace: float
) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, backend):
        tts = orpheus.TTS(engine=engine, seed=SEED)
        errors = _errors(tts)
        tts.on("error", lambda _: backend.stalling.clear())  # the stall ends with the first attempt
        events, error = await _collect(tts.synthesize(ONE, conn_options=_options(FLOW_TIMEOUT, max_retry=1)))
        assert error is None and [e.recoverable for e in errors] == [True]
        ids = [ev.request_id for ev in events]
        first, retry = (list(group) for _, group in itertools.groupby(events, key=lambda ev: ev.request_id))
        assert len(set(ids)) == 2  # two attempts, their frames not interleaved
        assert not any(ev.is_final for ev in first) and retry[-1].is_final
        assert _close(_pcm(retry), await _reference(backup, ONE))  # the retry spoke all of it, from the start


async def test_a_stream_that_already_spoke_is_not_retried(synthetic_config: EngineConfig, pace: float) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, _):
        tts = orpheus.TTS(engine=engine)
        errors = _errors(tts)
        events, error = await _collect(_request(tts, "stream", ONE, _options(FLOW_TIMEOUT, max_retry=2)))
        assert isinstance(error, APITimeoutError) and _pcm(events).size > 0
        assert [e.recoverable for e in errors] == [False]  # retrying would repeat what the user heard
        assert _count(engine, "streams_started") == 1


# ---------------------------------------------------------------------------------------------- StreamAdapter
async def test_a_stream_adapter_around_orpheus_speaks_each_sentence_as_one_request(backup: OrpheusEngine) -> None:
    adapter = StreamAdapter(tts=orpheus.TTS(engine=backup, seed=SEED))
    started = _count(backup, "streams_started")
    events, error = await _collect(_request(adapter, "stream", STORY, _options(FLOW_TIMEOUT)))
    assert error is None and len({ev.segment_id for ev in events}) == 1 and events[-1].is_final
    assert _count(backup, "streams_started") - started == 3
    pcm, reference = _pcm(events), np.concatenate([await _reference(backup, s) for s in SENTENCES])
    assert _close(pcm[: reference.size], reference)  # the sentences, in order, each spoken whole
    assert pcm.size - reference.size <= 240 and not pcm[reference.size :].any()  # then LiveKit's 10 ms end marker


async def test_a_stream_adapter_passes_the_timeout_to_orpheus(synthetic_config: EngineConfig, pace: float) -> None:
    async with controlled(synthetic_config, pace, stalling=True) as (engine, _):
        adapter = StreamAdapter(tts=orpheus.TTS(engine=engine))
        _, error = await _collect(_request(adapter, "stream", ONE, _options(NO_AUDIO_TIMEOUT)))
        assert isinstance(error, APITimeoutError)
        await _until(lambda: _idle(engine), timeout=2.0)


# ---------------------------------------------------------------------------------------------- FallbackAdapter
class Fallback:
    """A FallbackAdapter over a primary Orpheus TTS and a backup Orpheus TTS on a healthy engine, with its events."""

    def __init__(self, primary: orpheus.TTS, backup: OrpheusEngine, max_retry_per_tts: int) -> None:
        self.primary, self.backup_engine = primary, backup
        self.adapter = FallbackAdapter(
            [primary, orpheus.TTS(engine=backup, seed=SEED)], max_retry_per_tts=max_retry_per_tts
        )
        self.primary_errors = _errors(primary)
        self.availability: list[bool] = []  # the primary's, in order
        self.adapter.on("tts_availability_changed", self._changed)

    def _changed(self, ev: AvailabilityChangedEvent) -> None:
        if ev.tts is self.primary:
            self.availability.append(ev.available)

    async def speak(self, kind: str, conn_options: APIConnectOptions, text: str = ONE) -> str:
        """One request through the adapter; which TTS spoke it ("primary" or "backup")."""
        completed = _count(self.backup_engine, "streams_completed")
        events, error = await _collect(_request(self.adapter, kind, text, conn_options))
        assert error is None and _pcm(events).size > 0 and events[-1].is_final
        return "backup" if _count(self.backup_engine, "streams_completed") > completed else "primary"

    async def recovered(self, kind: str, conn_options: APIConnectOptions, timeout: float = 60.0) -> None:
        """Requests until a probe finds the primary healthy: each one that skips it starts a probe if none runs."""
        deadline = time.monotonic() + timeout
        while self.availability[-1:] != [True]:
            assert time.monotonic() < deadline, "the primary never recovered"
            await self.speak(kind, conn_options)
            with contextlib.suppress(AssertionError):
                await _until(lambda: self.availability[-1:] == [True], timeout=conn_options.timeout + 1.0)


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_fallback_adapter_fails_over_on_a_stall_and_recovers_once_it_clears(
    synthetic_config: EngineConfig, backup: OrpheusEngine, pace: float, kind: str
) -> None:
    options = _options(FLOW_TIMEOUT)
    async with controlled(synthetic_config, pace, stalling=True) as (engine, backend):
        fb = Fallback(orpheus.TTS(engine=engine, seed=SEED), backup, max_retry_per_tts=0)
        assert await fb.speak(kind, options) == "backup" and fb.availability == [False]
        assert {type(e.error) for e in fb.primary_errors} == {APITimeoutError}  # the request's, maybe its probe's
        assert _count(engine, "streams_cancelled") >= 1  # the stalled request was aborted, not left waiting
        backend.stalling.clear()
        await fb.recovered(kind, options)
        assert await fb.speak(kind, options) == "primary"
        await fb.adapter.aclose()


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
@pytest.mark.parametrize("cause", ["max_streams", "queue_timeout_s"])
async def test_fallback_adapter_fails_over_at_once_on_overload_and_recovers_when_there_is_room(
    synthetic_config: EngineConfig, backup: OrpheusEngine, pace: float, kind: str, cause: str
) -> None:
    options = APIConnectOptions(timeout=FLOW_TIMEOUT)  # LiveKit's retry_interval (2 s); 2 retries a TTS below
    config = {"max_streams": 1} if cause == "max_streams" else {"queue_timeout_s": 0.3}
    async with controlled(synthetic_config, pace, stalling=True, **config) as (engine, backend):
        fb = Fallback(orpheus.TTS(engine=engine, seed=SEED), backup, max_retry_per_tts=2)
        async with _held(engine, backend) if cause == "max_streams" else contextlib.nullcontext():
            assert await fb.speak(kind, options) == "backup" and fb.availability == [False]
        _assert_failed_at_once(fb.primary_errors, APIStatusError)  # the request's error, maybe its probe's
        assert all(e.error.status_code == 503 for e in fb.primary_errors)
        backend.stalling.clear()
        await fb.recovered(kind, options)
        assert await fb.speak(kind, options) == "primary"
        await fb.adapter.aclose()


def _assert_failed_at_once(errors: list[TTSError], kind: type[APIError]) -> None:
    """Errors of `kind`, none retryable, none followed by a retry (LiveKit emits a retried error as recoverable)."""
    assert errors and all(type(e.error) is kind and not e.error.retryable and not e.recoverable for e in errors)


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
@pytest.mark.parametrize("fault", ["closed", "failed", "weights missing"])
async def test_fallback_adapter_fails_over_at_once_from_an_engine_that_cannot_serve(
    synthetic_config: EngineConfig, backup: OrpheusEngine, pace: float, kind: str, fault: str
) -> None:
    options = APIConnectOptions(timeout=FLOW_TIMEOUT)
    async with _unserving(fault, synthetic_config, pace) as engine:
        fb = Fallback(orpheus.TTS(engine=engine), backup, max_retry_per_tts=2)
        assert await fb.speak(kind, options) == "backup" and fb.availability == [False]
        await _until(lambda: len(fb.primary_errors) >= 2)  # the request's error, then its recovery probe's
        _assert_failed_at_once(fb.primary_errors, APIError)  # not retried: this engine will not serve again
        assert await fb.speak(kind, options) == "backup" and fb.availability == [False]
        await fb.adapter.aclose()


@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_a_request_open_when_the_engine_fails_is_not_retried(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, backend):
        tts = orpheus.TTS(engine=engine)
        errors = _errors(tts)
        stream = _request(tts, kind, ONE, _options(60.0, max_retry=2))
        await asyncio.wait_for(stream.__anext__(), 10)  # it is speaking, and held mid-utterance
        backend.dying.set()  # the backend's stepping thread dies at its next step
        _, error = await _collect(stream)
        assert type(error) is APIError and not error.retryable
        assert [e.recoverable for e in errors] == [False] and engine.health()["status"] == "failed"


async def test_fallback_adapter_whose_every_tts_stalls_raises_api_connection_error(
    synthetic_config: EngineConfig, pace: float
) -> None:
    async with controlled(synthetic_config, pace, stalling=True) as (engine, _):
        first, second = orpheus.TTS(engine=engine), orpheus.TTS(engine=engine)
        adapter = FallbackAdapter([first, second], max_retry_per_tts=0)
        unavailable: list[TTS] = []
        adapter.on("tts_availability_changed", lambda ev: unavailable.append(ev.tts))
        _, error = await _collect(_request(adapter, "synthesize", ONE, _options(NO_AUDIO_TIMEOUT)))
        assert isinstance(error, APIConnectionError) and "all TTSs failed" in str(error)
        assert unavailable == [first, second]
        await adapter.aclose()  # cancels the recovery probes
        await _until(lambda: _idle(engine), timeout=2.0)


# ---------------------------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_aclose_mid_utterance_aborts_the_engine_request(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, _):
        stream = _request(orpheus.TTS(engine=engine), kind, STORY, _options(60.0))
        await asyncio.wait_for(stream.__anext__(), 10)  # it is speaking, and held mid-utterance
        assert engine.stats()["active_streams"] == 1
        await stream.aclose()
        await _until(lambda: _idle(engine), timeout=1.0)  # the backend drops the request within one engine step
        assert _count(engine, "streams_cancelled") == 1 and _count(engine, "streams_completed") == 0


async def test_tts_aclose_closes_its_open_streams(synthetic_config: EngineConfig, pace: float) -> None:
    async with controlled(synthetic_config, pace, stall_after=STALL_AFTER, stalling=True) as (engine, _):
        tts = orpheus.TTS(engine=engine)
        stream = _request(tts, "stream", STORY, _options(60.0))
        await asyncio.wait_for(stream.__anext__(), 10)
        await tts.aclose()
        await _until(lambda: _idle(engine), timeout=1.0)
        assert engine.ready  # the shared engine keeps serving


# ---------------------------------------------------------------------------------------------- admission
@pytest.mark.parametrize("kind", ["synthesize", "stream"])
async def test_an_overloaded_engine_fails_a_request_at_once_and_serves_it_once_there_is_room(
    synthetic_config: EngineConfig, pace: float, kind: str
) -> None:
    async with controlled(synthetic_config, pace, stalling=True, max_streams=1) as (engine, backend):
        tts = orpheus.TTS(engine=engine)
        errors = _errors(tts)
        async with _held(engine, backend):
            _, error = await _collect(_request(tts, kind, ONE, APIConnectOptions(timeout=FLOW_TIMEOUT)))  # 3 retries
        assert isinstance(error, APIStatusError) and error.status_code == 503 and not error.retryable
        assert [e.recoverable for e in errors] == [False] and _count(engine, "streams_rejected") == 1
        backend.stalling.clear()
        events, error = await _collect(_request(tts, kind, ONE, _options(FLOW_TIMEOUT)))
        assert error is None and events[-1].is_final


# ---------------------------------------------------------------------------------------------- many loops
def test_three_event_loops_in_three_threads_share_one_engine(
    synthetic_config: EngineConfig, backup: OrpheusEngine, pace: float
) -> None:
    """Each thread gets exactly the audio of its own request, identical to the same request made alone."""
    requests = [
        ("tara", 11, "First caller speaks here."),
        ("leo", 22, "The second caller says something longer."),
        ("zoe", 33, "Third!"),
    ]

    async def speak(engine: OrpheusEngine, voice: str, seed: int, text: str) -> np.ndarray:
        events, error = await _collect(orpheus.TTS(engine=engine, voice=voice, seed=seed).synthesize(text))
        assert error is None
        return _pcm(events)

    async def main() -> dict[int, np.ndarray]:
        async with controlled(synthetic_config, pace, stalling=True) as (engine, backend):
            results: dict[int, np.ndarray] = {}

            def job(i: int) -> None:
                results[i] = asyncio.run(speak(engine, *requests[i]))  # a new event loop in this thread

            threads = [threading.Thread(target=job, args=(i,)) for i in range(len(requests))]
            for t in threads:
                t.start()
            await _until(lambda: engine.stats()["active_streams"] == len(requests))  # all three in, held
            backend.stalling.clear()
            await asyncio.to_thread(lambda: [t.join(30) for t in threads])
            assert engine.stats()["active_streams"] == 0
            return results

    reference = [asyncio.run(speak(backup, *req)) for req in requests]  # one at a time
    results = asyncio.run(main())
    assert len({ref.size for ref in reference}) == len(requests)  # different lengths: a mix-up cannot go unnoticed
    for i, ref in enumerate(reference):
        assert _close(results[i], ref)


# ---------------------------------------------------------------------------------------------- worker load
async def test_engine_load_fnc_reports_stream_and_job_load_and_a_dead_engine_as_full(
    synthetic_config: EngineConfig, pace: float
) -> None:
    async with controlled(synthetic_config, pace, stalling=True, max_streams=4) as (engine, backend):
        options = orpheus.server_options(engine, load_threshold=0.5)
        server = AgentServer(**options)
        assert server.load_fnc(server) == 0.0
        async with _held(engine, backend):
            assert server.load_fnc(server) == 0.25
        await _kill(engine, backend)
        assert server.load_fnc(server) == 1.0  # a failed engine serves nothing: take no new calls here
    assert server.load_fnc(server) == 1.0  # closed


# ---------------------------------------------------------------------------------------------- measurement
async def _failover_seconds(
    config: EngineConfig, cause: str, retries: int, options: APIConnectOptions, backup: OrpheusEngine
) -> float:
    """Seconds from a FallbackAdapter request to the backup's first audio, with the primary stalled or full."""
    overrides = {"max_streams": 1} if cause == "overload" else {}
    async with controlled(config, 0.0, stalling=True, **overrides) as (engine, backend):
        adapter = FallbackAdapter([orpheus.TTS(engine=engine), orpheus.TTS(engine=backup)], max_retry_per_tts=retries)
        async with _held(engine, backend) if cause == "overload" else contextlib.nullcontext():
            start = time.perf_counter()
            async with adapter.synthesize(ONE, conn_options=options) as stream:
                await stream.__anext__()
                seconds = time.perf_counter() - start
        await adapter.aclose()
        return seconds


async def _measure(runs: int, defaults_stall: bool) -> None:
    """Print the failover times, with the recommended options and with LiveKit's defaults."""
    from orpheus_tts_plugin.tools.testmodel import write_snac

    with tempfile.TemporaryDirectory() as tmp:
        write_snac(Path(tmp) / "snac", "tiny")
        config = EngineConfig(model=None, backend="synthetic", snac=str(Path(tmp) / "snac"), device="cpu")
        backup = OrpheusEngine(config)
        await backup.start()
        ttfb = []
        for _ in range(runs):
            start = time.perf_counter()
            async with orpheus.TTS(engine=backup).synthesize(ONE) as stream:
                await stream.__anext__()
                ttfb.append(time.perf_counter() - start)
        print(f"backup TTS alone, first audio: median {statistics.median(ttfb) * 1000:.0f} ms")
        settings = [
            ("recommended: max_retry_per_tts=0, timeout=2.0", 0, APIConnectOptions(max_retry=0, timeout=2.0)),
            ("LiveKit defaults: max_retry_per_tts=2, timeout=10, retry_interval=2", 2, APIConnectOptions(max_retry=0)),
        ]
        for label, retries, options in settings:
            for cause in ("overload", "stall"):
                if cause == "stall" and retries and not defaults_stall:
                    continue
                times = [await _failover_seconds(config, cause, retries, options, backup) for _ in range(runs)]
                shown = ", ".join(f"{t:.3f}" for t in times)
                print(f"{label}; {cause}: request -> backup's first audio {shown} s")
        await backup.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="FallbackAdapter failover time, Orpheus primary stalled or full")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--defaults-stall", action="store_true", help="also the stall with LiveKit's defaults (~32 s a run)"
    )
    args = parser.parse_args()
    logging.getLogger("livekit.agents").setLevel(logging.ERROR)  # each failover logs a warning: expected here
    asyncio.run(_measure(args.runs, args.defaults_stall))
