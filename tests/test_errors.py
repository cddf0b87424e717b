"""What each failure means to a caller: one classification, which every framework adapter maps to its own errors."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin.errors import (
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineOverloadedError,
    Failure,
    ModelLoadError,
    failure_of,
)

CASES = [
    (TimeoutError("slow"), True, Failure.TIMEOUT),
    (EngineOverloadedError("full"), True, Failure.OVERLOADED),
    (EngineFailedError("dead"), True, Failure.ENGINE_FAILED),
    (ModelLoadError("no weights"), False, Failure.LOAD_FAILED),
    (EngineClosedError("closed"), False, Failure.CLOSED),
    (ValueError("bad voice"), True, Failure.BAD_INPUT),
    (TypeError("bad type"), False, Failure.BAD_INPUT),
    (EngineError("one stream failed"), True, Failure.STREAM_FAILED),
    (EngineError("a stream of a dead engine"), False, Failure.ENGINE_DOWN),
    (RuntimeError("bug"), True, Failure.UNEXPECTED),
    (RuntimeError("bug in a dead engine"), False, Failure.ENGINE_DOWN),
]


@pytest.mark.parametrize(("exc", "serving", "kind"), CASES, ids=[c[2].name + ("" if c[1] else "-down") for c in CASES])
def test_each_failure_is_classified_by_its_type_and_whether_the_engine_still_serves(
    exc: Exception, serving: bool, kind: Failure
) -> None:
    assert failure_of(exc, serving=serving) is kind


def test_both_adapters_map_every_kind_of_failure() -> None:
    pytest.importorskip("pipecat")
    pytest.importorskip("livekit.agents")
    from orpheus_tts_plugin.livekit.tts import _API_ERRORS
    from orpheus_tts_plugin.pipecat.health import _REPORTS

    assert set(_REPORTS) == set(Failure) == set(_API_ERRORS)
