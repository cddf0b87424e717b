"""Helpers shared by test files: backends that hold a request at a point of the test's choosing (no sleeps, no
timing luck), the two generation speeds, an engine started for a block."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend

SPEEDS = {"faster": 0.0, "slower": 300.0}  # synthetic tokens a second a stream; 0: as fast as the thread steps
SPEED_IDS = [f"generation-{k}-than-decoding" for k in SPEEDS]


class GatedBackend(SyntheticBackend):
    """Synthetic tokens; a request whose prompt mentions `word` stops after its first `after` tokens until `gate`."""

    def __init__(self, config: SyntheticConfig, word: bytes = b"hold", after: int = 1, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.gate = threading.Event()
        self.word, self.after = word, after

    def _admit(self, req):  # type: ignore[no-untyped-def]
        state = super()._admit(req)
        state["hold"] = self.word in bytes(i for i in req.prompt_ids if i < 256)
        return state

    def _step(self, states):  # type: ignore[no-untyped-def]
        if not self.gate.is_set() and any(st["hold"] and st["i"] >= self.after for st in states):
            time.sleep(0.005)
            return [([], None)] * len(states)
        return super()._step(states)


@contextlib.asynccontextmanager
async def started(config: EngineConfig, **kwargs: Any) -> AsyncIterator[OrpheusEngine]:
    """A started engine of its own, closed on exit."""
    engine = OrpheusEngine(config, **kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.aclose()
