"""Fixtures of the server tests: an engine behind a server thread and a RemoteEngine on it, built once a module.

Every engine-behaviour test runs twice: with generation faster than decoding (synthetic tokens flat
out) and slower (synthetic tokens paced), so that neither order of arrival hides a bug.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest

from orpheus_tts_plugin import (
    EngineConfig,
    RemoteEngine,
    SyntheticConfig,
)
from orpheus_tts_plugin.server.serve import ServerThread
from tests.server.harness import MAX_STREAMS, PACES, endless, serving


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
