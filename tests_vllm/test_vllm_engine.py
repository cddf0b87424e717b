"""The whole OrpheusEngine on backend="vllm" (vLLM's CPU build), built from an EngineConfig alone.

Generation speed: vLLM on 2 CPU cores is slower than decoding; a run faster than decoding needs a GPU, so only the
natural speed runs here. Waits are hang guards, never speed expectations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.spec import ENGLISH, SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.replay import replay_offline

GUARD_S = 180


@pytest.fixture(scope="module")
async def engine(vllm_config: EngineConfig):
    eng = OrpheusEngine(vllm_config)
    await eng.start()
    yield eng
    await eng.aclose()


async def collect(engine: OrpheusEngine, text: str, **kwargs) -> list:
    return await drain(engine.synthesize(text, **kwargs))


async def drain(stream) -> list:
    """Every chunk left in `stream`; the wait is a hang guard."""

    async def run() -> list:
        return [chunk async for chunk in stream]

    return await asyncio.wait_for(run(), GUARD_S)


def pcm(chunks: list) -> np.ndarray:
    return np.frombuffer(b"".join(c.pcm for c in chunks), dtype="<i2")


async def until(cond: Callable[[], bool]) -> None:
    """Wait for `cond` (set on the engine's own loop); fails only if it never comes (a hang guard)."""
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_vllm_streams_decodable_audio_equal_to_the_offline_decode(engine: OrpheusEngine, test_model_dir) -> None:
    log: list[int] = []
    chunks = await collect(engine, "Hi. Short one.", voice="tara", seed=3, token_log=log)
    streamed = pcm(chunks)
    offline = replay_offline(load_snac(str(test_model_dir / "snac")), np.array(log), ENGLISH)
    assert streamed.size == offline.size > 0
    assert np.abs(streamed.astype(int) - offline.astype(int)).max() <= 33
    stats = engine.stats()
    assert stats.get("invalid_wrong_position", 0) == 0  # the logits processor: every id at its frame position
    assert not any(k.startswith("invalid_") and v for k, v in stats.items())
    assert stats["frames"] > 0 and stats["backend"]["backend"] == "vllm"


async def test_max_tokens_caps_generation(engine: OrpheusEngine) -> None:
    before = engine.stats().get("finish_max_tokens", 0)
    chunks = await collect(engine, "Capped.", max_tokens=70, seed=1)
    assert pcm(chunks).size == 10 * SAMPLES_PER_FRAME
    assert engine.stats()["finish_max_tokens"] == before + 1


async def test_a_caller_that_stops_reading_has_its_vllm_request_paused_then_resumed_with_the_same_ids(
    engine: OrpheusEngine,
) -> None:
    """Greedy, one sentence of 60 frames: the caller leaves 2 s (`pause_unread_s`, the default) unread long before."""
    text, greedy = "One sentence that runs long enough to leave audio unread.", {"temperature": 0.0, "max_tokens": 420}
    whole: list[int] = []
    await collect(engine, text, token_log=whole, **greedy)  # read as it comes: never paused
    pauses = engine.stats().get("generation_pauses", 0)
    log: list[int] = []
    stalled = engine.synthesize(text, token_log=log, **greedy)
    chunks = [await asyncio.wait_for(stalled.__anext__(), GUARD_S)]  # then it reads nothing for a while
    await until(lambda: engine.stats()["backend"]["paused_requests"] == 1)
    await until(lambda: engine.stats()["backend"]["vllm_unfinished_requests"] == 0)  # gone from vLLM meanwhile
    assert engine.stats()["generation_pauses"] == pauses + 1
    chunks += await drain(stalled)  # reading again resumes it
    assert chunks[-1].final and log == whole  # nothing lost, nothing twice
    backend = engine.stats()["backend"]
    assert backend["paused_requests"] == 0 and backend["live_requests"] == 0 and backend["resumes"] >= 1
    assert not any(k.startswith("invalid_") and v for k, v in engine.stats().items())


async def test_leaving_the_stream_early_aborts_the_vllm_request(engine: OrpheusEngine) -> None:
    async for _chunk in engine.synthesize("A long sentence to interrupt. " * 4, seed=2):
        break  # barge-in
    await until(lambda: engine.stats()["active_streams"] == 0)
    await until(lambda: engine.stats()["backend"]["vllm_unfinished_requests"] == 0)
    backend = engine.stats()["backend"]
    assert backend["live_requests"] == 0 and backend["aborted"] >= 1
