"""The adapters' engine fixtures, shared by every module here: one engine of each kind per module and pace."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from tests.adapters.test_pipecat import PACINGS, closing_engine, controlled_engine, paced


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
