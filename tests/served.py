"""What the tests of `orpheus-tts serve` (tests/server/) and of its client (tests/client/) share: an engine served in a
thread, HTTP and /metrics reads, audio compared with the engine's own, and their fixtures (a served engine and a
RemoteEngine on it, built once a module), which each folder's conftest.py takes from here.

Every engine-behaviour test runs twice: with generation faster than decoding (synthetic tokens flat
out) and slower (synthetic tokens paced), so that neither order of arrival hides a bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from orpheus_tts_plugin import (
    EngineConfig,
    OrpheusEngine,
    RemoteEngine,
    SyntheticConfig,
)
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread

PACES = {"fast": 0.0, "paced": 400.0}  # synthetic tokens/s a stream: 0 outruns the decoder, 400 makes it wait
TEXT = "Hello there. How are you today?"
MAX_STREAMS = 8
TOLERANCE = 2  # int16 steps: the decoder's batching varies from run to run


@contextlib.contextmanager
def serving(config: EngineConfig, **options: Any) -> Iterator[ServerThread]:
    """An engine of `config` behind a server thread, once loaded (the server's start-up loads it)."""
    engine = OrpheusEngine(config)
    with serving_in_thread(engine, **options) as srv:
        deadline = time.monotonic() + 120
        while not engine.ready:
            assert engine.health()["status"] == "starting" and time.monotonic() < deadline, engine.health()
            time.sleep(0.01)
        yield srv


def endless(config: EngineConfig) -> EngineConfig:
    """Utterances that never end by themselves: a cancel or a drain always lands in the middle of generation,
    however fast the host generates (a long but finite one was over before its first audio on slow hosts)."""
    return replace(config, token_budget_base=1_000_000, synthetic=replace(config.synthetic, endless=True))


def engine_of(srv: ServerThread) -> OrpheusEngine:
    return srv.service.engine


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def idle(srv: ServerThread) -> bool:
    stats = engine_of(srv).stats()
    return stats["active_streams"] == 0 and stats["backend"]["live_requests"] == 0


async def pcm_of(engine: Any, text: str = TEXT, **options: Any) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(text, **options)]), dtype="<i2")


def assert_same_audio(got: np.ndarray, reference: np.ndarray) -> None:
    assert got.size == reference.size > 0
    assert np.abs(got.astype(np.int32) - reference).max() <= TOLERANCE


def http(srv: ServerThread, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, or of a POST when `body` is given."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.http_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(srv: ServerThread, name: str) -> float:
    """A /metrics sample (`name` with or without its labels: summed over the labels not given)."""
    _, text = http(srv, "/metrics")
    lines = [line for line in text.decode().splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def one_connection(srv: ServerThread, timeout: float = 20.0) -> None:
    """Wait until the server holds exactly one WebSocket (connections other tests closed may still be going)."""
    deadline = time.monotonic() + timeout
    while metric(srv, "orpheus_ws_connections") != 1:
        assert time.monotonic() < deadline, "the server does not hold exactly one connection"
        time.sleep(0.01)


@pytest.fixture(scope="module", params=list(PACES))
def config(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> EngineConfig:
    return replace(
        synthetic_config, max_streams=MAX_STREAMS, synthetic=SyntheticConfig(tokens_per_second=PACES[request.param])
    )


@pytest.fixture(scope="module")
def served(config: EngineConfig) -> Iterator[ServerThread]:
    with serving(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def remote(served: ServerThread) -> Iterator[RemoteEngine]:
    """One RemoteEngine for the module's tests (each test runs on its own event loop)."""
    engine = RemoteEngine(served.url)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def long_served(config: EngineConfig) -> Iterator[ServerThread]:
    with serving(endless(config)) as srv:
        yield srv
