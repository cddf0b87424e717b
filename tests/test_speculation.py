"""Speculative streams: each counted once as confirmed or discarded, in every order, and what discarded ones cost."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.spec import SAMPLE_RATE, SAMPLES_PER_FRAME
from orpheus_tts_plugin.speculation import STAT_KEYS, SpeculationTally
from tests.stubs import SPEED_IDS, SPEEDS

TEXT = "Hello there. How are you today?"
SHORT = {"text": "Hello there.", "max_tokens": 56}  # a stream that ends whole soon at either pace (8 frames)


@pytest.fixture(scope="module", params=list(SPEEDS.values()), ids=SPEED_IDS)
def paced(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    engine = OrpheusEngine(replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param)))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


def _delta(engine: OrpheusEngine, before: dict) -> dict:
    after = engine.stats()
    return {key: after.get(key, 0) - before.get(key, 0) for key in (*STAT_KEYS, "frames", "tokens")}


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _idle(engine: OrpheusEngine) -> None:
    await _until(lambda: engine.stats()["active_streams"] == 0 and engine.stats()["backend"]["live_requests"] == 0)


def _counts(delta: dict) -> tuple[int, int, int]:
    return delta["speculative_started"], delta["speculative_confirmed"], delta["speculative_discarded"]


async def test_a_speculation_confirmed_while_it_generates_counts_confirmed_once(paced: OrpheusEngine) -> None:
    before = paced.stats()
    speech = paced.synthesize(**SHORT, speculative=True)
    assert speech.speculative
    chunks = [await anext(speech)]
    speech.confirm()
    speech.confirm()
    chunks += [chunk async for chunk in speech]
    await speech.aclose()
    assert chunks[-1].final
    delta = _delta(paced, before)
    assert _counts(delta) == (1, 1, 0)
    assert delta["speculative_discarded_audio_s"] == delta["speculative_discarded_open_s"] == 0


async def test_a_speculation_confirmed_after_it_ended_or_before_it_began_counts_confirmed(paced: OrpheusEngine) -> None:
    before = paced.stats()
    ended = paced.synthesize(**SHORT, speculative=True)
    assert [chunk async for chunk in ended][-1].final
    assert _counts(_delta(paced, before)) == (1, 0, 0)  # ended whole, not settled yet
    ended.confirm()
    await ended.aclose()
    early = paced.synthesize(**SHORT, speculative=True)
    early.confirm()
    assert [chunk async for chunk in early][-1].final
    del early
    assert _counts(_delta(paced, before)) == (2, 2, 0)


async def test_a_speculation_closed_before_its_confirm_is_discarded_and_aborted_within_a_step(
    paced: OrpheusEngine,
) -> None:
    before = paced.stats()
    speech = paced.synthesize(TEXT * 3, speculative=True)
    await anext(speech)
    await speech.aclose()
    speech.confirm()  # too late: it stays discarded
    await _idle(paced)
    await _until(lambda: paced.stats()["speculative_discarded_audio_s"] > before["speculative_discarded_audio_s"])
    delta = _delta(paced, before)
    assert _counts(delta) == (1, 0, 1)
    assert 0 < delta["speculative_discarded_audio_s"] <= delta["frames"] * SAMPLES_PER_FRAME / SAMPLE_RATE + 1e-3
    assert delta["speculative_discarded_open_s"] > 0
    assert paced.stats()["backend"]["max_steps_to_abort"] <= 1
    tokens = paced.stats()["tokens"]
    await asyncio.sleep(0.1)
    assert paced.stats()["tokens"] == tokens  # nothing more is generated for it


async def test_a_speculation_closed_after_its_confirm_counts_confirmed_not_discarded(paced: OrpheusEngine) -> None:
    before = paced.stats()
    speech = paced.synthesize(TEXT * 3, speculative=True)
    await anext(speech)
    speech.confirm()
    await speech.aclose()
    await _idle(paced)
    delta = _delta(paced, before)
    assert _counts(delta) == (1, 1, 0)
    assert delta["speculative_discarded_audio_s"] == 0


async def test_a_speculation_ended_whole_then_dropped_unconfirmed_is_discarded_with_all_its_audio(
    paced: OrpheusEngine,
) -> None:
    before = paced.stats()
    speech = paced.synthesize(**SHORT, speculative=True)
    assert [chunk async for chunk in speech][-1].final
    del speech
    delta = _delta(paced, before)
    assert _counts(delta) == (1, 0, 1)
    assert delta["speculative_discarded_audio_s"] == pytest.approx(
        delta["frames"] * SAMPLES_PER_FRAME / SAMPLE_RATE, abs=1e-3
    )


async def test_a_speculation_left_early_or_cancelled_is_discarded_once(paced: OrpheusEngine) -> None:
    before = paced.stats()

    async def leave_early() -> None:
        async for _chunk in paced.synthesize(TEXT * 3, speculative=True):
            break

    async def read_slowly() -> None:
        async for _chunk in paced.synthesize(TEXT * 3, speculative=True):
            await asyncio.sleep(10)

    await leave_early()
    slow = asyncio.create_task(read_slowly())
    await _until(lambda: paced.stats()["speculative_started"] == before["speculative_started"] + 2)
    slow.cancel()
    await asyncio.gather(slow, return_exceptions=True)
    del slow
    await _idle(paced)
    await _until(lambda: paced.stats()["speculative_discarded"] == before["speculative_discarded"] + 2)
    assert _counts(_delta(paced, before)) == (2, 0, 2)


async def test_a_stream_not_speculative_or_never_started_counts_nothing(paced: OrpheusEngine) -> None:
    before = paced.stats()
    plain = paced.synthesize(**SHORT)
    assert not plain.speculative
    plain.confirm()  # a no-op
    assert [chunk async for chunk in plain][-1].final
    await plain.aclose()
    never = paced.synthesize(**SHORT, speculative=True)
    await never.aclose()
    empty = paced.synthesize("  ", speculative=True)
    assert [chunk async for chunk in empty] == []
    del never, empty
    assert _counts(_delta(paced, before)) == (0, 0, 0)


def test_speculative_must_be_a_bool(paced: OrpheusEngine) -> None:
    with pytest.raises(TypeError, match="speculative must be a bool"):
        paced.synthesize(TEXT, speculative=1)


@pytest.mark.parametrize("outcome", ["confirm", "discard", "dropped"])
def test_every_order_of_a_speculations_events_counts_it_once(outcome: str) -> None:
    events = ("started", "released", "ended", outcome)
    for order in itertools.permutations(events):
        if order.index("started") > min(order.index("released"), order.index("ended")):
            continue  # the engine stamps its own events in this order: admitted, then released or ended
        tally = SpeculationTally()
        spec = tally.open()
        for event in order:
            getattr(spec, event)(*((2.5,) if event == "ended" else ()))
        spec.confirm()
        spec.discard()
        stats = tally.stats()
        discarded = outcome != "confirm"
        assert (stats["speculative_started"], stats["speculative_confirmed"], stats["speculative_discarded"]) == (
            1,
            int(not discarded),
            int(discarded),
        ), order
        assert stats["speculative_discarded_audio_s"] == (2.5 if discarded else 0), order
