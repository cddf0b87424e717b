"""Fixtures of the examples' tests: the phone agent's caller speech."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def question(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The caller's question (8 kHz μ-law), made from text by the example's fixture script (espeak-ng)."""
    from examples.pipecat_phone_agent.make_fixtures import make_fixtures

    return make_fixtures(tmp_path_factory.mktemp("caller-fixtures"))["question"]
