"""The engine under production-like conditions, each with generation faster than decoding and slower.

Order of sentences, bounded decoder work, fault isolation, bounded queueing, input checks and memory,
through the public API: OrpheusEngine with an injected backend or decoder where a fault must be made.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from orpheus_tts_plugin import (
    EngineConfig,
    EngineError,
    EngineFailedError,
    EngineOverloadedError,
    OrpheusEngine,
    SyntheticConfig,
)
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.codec.decoder import StreamingDecoder
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.spec import ENGLISH, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from orpheus_tts_plugin.speech.prompt import sentence_requests
from orpheus_tts_plugin.speech.text import split_sentences
from tests.stubs import SPEED_IDS, SPEEDS, GatedBackend, started

SIX = (
    "The first sentence is short. Here comes the second one. A third follows it. "
    "Then a fourth arrives at last. The fifth is nearly done. And this is the sixth."
)


@pytest.fixture(params=list(SPEEDS.values()), ids=SPEED_IDS)
def config(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> EngineConfig:
    return replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param))


async def pcm(engine: OrpheusEngine, text: str, **options: Any) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(text, **options)]), "<i2")


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.size == b.size, (a.size, b.size)
    return int(np.abs(a.astype(int) - b.astype(int)).max()) if a.size else 0


async def until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------ 1. order


async def test_each_sentence_of_a_long_text_equals_that_sentence_spoken_alone_with_its_seed(
    config: EngineConfig,
) -> None:
    config = replace(config, sentence_max_chars=40)
    pieces = split_sentences(SIX, 40)
    assert len(pieces) == 6
    async with started(config) as engine:
        whole = await pcm(engine, SIX, seed=7)
        alone = [await pcm(engine, piece, seed=7 + i) for i, piece in enumerate(pieces)]
    assert max_diff(whole, np.concatenate(alone)) <= 2


async def test_eight_concurrent_multi_sentence_streams_each_come_out_in_order(config: EngineConfig) -> None:
    config = replace(config, sentence_max_chars=40)
    async with started(config) as engine:
        together = await asyncio.gather(*(pcm(engine, SIX, seed=100 * k) for k in range(8)))
        pieces = split_sentences(SIX, 40)
        alone = await asyncio.gather(
            *(pcm(engine, p, seed=100 * k + i) for k in range(8) for i, p in enumerate(pieces))
        )
        for k, got in enumerate(together):
            assert max_diff(got, np.concatenate(alone[k * len(pieces) : (k + 1) * len(pieces)])) <= 2


# ------------------------------------------------------------------ 2. bounded work


async def test_a_long_backlog_is_decoded_in_bounded_calls_in_order_with_nothing_lost(config: EngineConfig) -> None:
    text = " ".join(f"Sentence number {i} of a very long text, long enough to need many requests." for i in range(40))
    short = replace(config.synthetic, frames_per_prompt_token=0.1)
    config = replace(config, synthetic=short, sentence_max_chars=120)
    pieces = split_sentences(text, 120)
    async with started(config) as engine:
        whole = await pcm(engine, text, seed=1)
        stats = engine.stats()
        alone = [await pcm(engine, p, seed=1 + i) for i, p in enumerate(pieces)]
    assert max_diff(whole, np.concatenate(alone)) <= 2
    assert whole.size == stats["frames"] * SAMPLES_PER_FRAME  # every frame, each once
    first, flush = config.first_chunk_frames, 3
    assert set(stats["decoder_calls_by_chunk"]) <= {1, flush, first, first + flush}  # at most 4 frames an utterance
    assert stats["decoder_padded_rows"] >= 0 and stats["decoder_free_slots"] == config.max_streams


def test_decoder_calls_hold_at_most_four_frames_an_utterance_and_a_bounded_batch(test_model_dir) -> None:
    decoder = StreamingDecoder(load_snac(str(test_model_dir / "snac")), max_streams=64, batch_frames=32)
    states = [decoder.new_state() for _ in range(20)]
    rng = np.random.default_rng(0)
    for st in states:
        st.pending.append(rng.integers(0, 4096, (50, TOKENS_PER_FRAME)))
    calls = decoder.calls
    audio = decoder.decode(states)
    assert all(a.size == 4 * SAMPLES_PER_FRAME - decoder.latency_samples for a in audio)  # first chunks only
    assert decoder.calls - calls == 3  # 20 rows of 4 frames in calls of at most 32 frames: 8 + 8 + 4 rows
    assert all(st.pending_frames == 46 for st in states)
    rows = {n: [b for b, c in decoder.buckets() if c == n] for n in (1, 3, 4, 7)}
    assert rows == {1: [1, 2, 4, 8, 16, 32], 3: [1, 2, 4, 8], 4: [1, 2, 4, 8], 7: [1, 2, 4]}
    assert len(decoder.buckets()) == 17


# ------------------------------------------------------------------ 3. isolation


def test_a_call_that_fails_is_retried_row_by_row_so_only_the_bad_row_fails(test_model_dir) -> None:
    decoder = StreamingDecoder(load_snac(str(test_model_dir / "snac")))
    good, bad = decoder.new_state(), decoder.new_state()
    rng = np.random.default_rng(1)
    good.pending.append(rng.integers(0, 4096, (4, 7)))
    bad.pending.append(np.full((4, 7), 4096))  # out of SNAC's codebook: the call raises
    alone = decoder.new_state()
    alone.pending.append(good.pending[0].copy())
    expected = StreamingDecoder(decoder.snac).decode([alone])[0]
    out = decoder.decode([good, bad])
    assert isinstance(out[1], Exception) and bad.frames_in == 0 and bad.pending_frames == 4  # state unchanged
    assert max_diff(out[0], expected) <= 1 and good.frames_in == 4
    assert decoder.stats()["decoder_failed_calls"] == 2 and bad.slot is None


POISON_SEED = 999


class PoisonedDecoder(StreamingDecoder):
    """A real decoder that corrupts the frames of the stream seeded POISON_SEED (codes out of the codebook)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.poison = np.random.default_rng(POISON_SEED).integers(0, 4096, size=TOKENS_PER_FRAME)
        self.faulted_at: float | None = None

    def decode(self, states):  # type: ignore[no-untyped-def]
        for st in states:
            if st.frames_in == 0 and st.pending and np.array_equal(st.pending[0][0], self.poison):
                st.pending[0] = np.full_like(st.pending[0], 4096)
                self.faulted_at = time.perf_counter()
        return super().decode(states)


async def test_a_decode_fault_ends_only_its_stream_within_one_tick(config: EngineConfig, test_model_dir) -> None:
    decoder = PoisonedDecoder(load_snac(str(test_model_dir / "snac")))
    async with started(config, decoder=decoder) as engine:
        expected = {s: await pcm(engine, "Good morning to you.", seed=s) for s in (1, 2, 3)}
        ticks = engine.stats()["decoder_ticks"]

        async def poisoned() -> tuple[float, int]:
            with pytest.raises(EngineError, match="decoding failed"):
                await pcm(engine, "Good morning to you.", seed=POISON_SEED)
            return time.perf_counter(), engine.stats()["decoder_ticks"]

        results = await asyncio.gather(poisoned(), *(pcm(engine, "Good morning to you.", seed=s) for s in (1, 2, 3)))
        (failed_at, ticks_at_error), *others = results
        for s, got in zip((1, 2, 3), others):
            assert max_diff(got, expected[s]) <= 2
        assert failed_at - decoder.faulted_at < 1.0  # the error reaches its caller at once (one tick)
        assert ticks_at_error > ticks
        await until(lambda: engine.stats()["active_streams"] == 0)
        assert engine.health()["status"] == "ok"
        assert (await pcm(engine, "Still serving.", seed=4)).size > 0


class PoisonedBackend(SyntheticBackend):
    """Synthetic tokens, but a request whose prompt mentions 'poison' fails when admitted."""

    def _admit(self, req):  # type: ignore[no-untyped-def]
        if b"poison" in bytes(i for i in req.prompt_ids if i < 256):
            raise RuntimeError("injected backend fault")
        return super()._admit(req)


async def test_a_backend_fault_ends_only_its_stream(config: EngineConfig) -> None:
    async with started(config, backend=PoisonedBackend(config.synthetic)) as engine:
        good = asyncio.gather(*(pcm(engine, "Hello there.", seed=s) for s in range(3)))
        with pytest.raises(EngineError, match="backend"):
            await pcm(engine, "A poison pill.", seed=9)
        assert all(a.size > 0 for a in await good)
        await until(lambda: engine.stats()["active_streams"] == 0)


async def test_a_caller_whose_event_loop_died_is_dropped_and_the_others_go_on(config: EngineConfig) -> None:
    async with started(config) as engine:

        def caller() -> None:  # a thread whose loop reads one chunk and then dies without closing the stream
            loop = asyncio.new_event_loop()
            stream = engine.synthesize(SIX * 3, seed=1)
            loop.run_until_complete(stream.__anext__())
            loop.close()

        await asyncio.to_thread(caller)
        assert (await pcm(engine, "Others go on.", seed=2)).size > 0
        await until(lambda: engine.stats()["active_streams"] == 0)
        await until(lambda: engine.stats()["backend"]["live_requests"] == 0)


class FatalDecoder(StreamingDecoder):
    """Kills the decoder thread (an exception that is not an Exception) after `after` calls."""

    class Fatal(BaseException):
        pass

    def __init__(self, *args: Any, after: int = 3, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.after = after

    def decode(self, states):  # type: ignore[no-untyped-def]
        if self.calls >= self.after:
            raise self.Fatal("injected thread death")
        return super().decode(states)


async def test_if_the_decoder_thread_dies_every_open_and_new_stream_fails_at_once(
    config: EngineConfig, test_model_dir
) -> None:
    decoder = FatalDecoder(load_snac(str(test_model_dir / "snac")), after=3)
    async with started(config, decoder=decoder) as engine:
        streams = [engine.synthesize(SIX, seed=s) for s in range(4)]
        with pytest.raises(EngineFailedError, match="decoder thread died"):
            await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams)), 30)
        health = engine.health()
        assert health["status"] == "failed" and "Fatal" in health["reason"]
        assert engine.stats()["status"] == "failed" and engine.stats()["active_streams"] == 0
        t = time.perf_counter()
        with pytest.raises(EngineFailedError):
            await pcm(engine, "Anyone there?")
        assert time.perf_counter() - t < 1.0 and not engine.ready


async def _drain(stream: Any) -> None:
    async for _chunk in stream:
        pass


class DyingBackend(SyntheticBackend):
    """Its stepping thread dies after `after` steps."""

    def __init__(self, config: SyntheticConfig, after: int):
        super().__init__(config)
        self.after = after

    def _step(self, states):  # type: ignore[no-untyped-def]
        if self._step_count >= self.after:
            raise SystemExit("injected stepping-thread death")
        return super()._step(states)


async def test_if_the_backend_thread_dies_its_streams_fail_and_new_ones_fail_at_once(config: EngineConfig) -> None:
    async with started(config, backend=DyingBackend(config.synthetic, after=50)) as engine:
        with pytest.raises(EngineFailedError, match="stepping thread died"):
            await asyncio.wait_for(pcm(engine, SIX * 4, seed=1), 30)
        assert engine.health()["status"] == "failed" and "stepping thread died" in engine.health()["reason"]
        with pytest.raises(EngineFailedError):
            await pcm(engine, "Anyone there?")


# ------------------------------------------------------------------ 4. admission


async def test_a_request_queued_behind_a_full_batch_past_the_timeout_is_overloaded(config: EngineConfig) -> None:
    config = replace(config, max_streams=4, max_batch_size=1, queue_timeout_s=0.3)
    backend = GatedBackend(config.synthetic, max_batch_size=1)
    async with started(config, backend=backend) as engine:
        holder = asyncio.ensure_future(pcm(engine, "Please hold the line.", seed=1))
        await until(lambda: engine.stats()["backend"]["live_requests"] == 1)
        t = time.perf_counter()
        with pytest.raises(EngineOverloadedError, match="queue_timeout_s"):
            await pcm(engine, "Let me in.", seed=2)
        waited = time.perf_counter() - t
        assert 0.3 <= waited < 5.0
        backend.gate.set()
        assert (await holder).size > 0
        assert engine.stats()["queue_timeouts"] == 1
        await until(lambda: engine.stats()["backend"]["queued_requests"] == 0)
        assert (await pcm(engine, "Let me in now.", seed=2)).size > 0


# ------------------------------------------------------------------ 5. input


@pytest.mark.parametrize(
    ("options", "error", "field"),
    [
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": 10**30}, ValueError, "seed"),
        ({"seed": "7"}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.01}, ValueError, "top_p"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, ValueError, "repetition_penalty"),
        ({"max_tokens": 1.5}, TypeError, "max_tokens"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"stop": 3}, TypeError, "unknown sampling option"),
        ({"voice": 3}, TypeError, "voice"),
    ],
    ids=str,
)
def test_bad_values_are_refused_before_anything_starts(options: dict, error: type, field: str) -> None:
    engine = OrpheusEngine(EngineConfig(model=None, backend="synthetic", decoder="null"))
    with pytest.raises(error, match=field):
        engine.synthesize("Hello.", **options)
    with pytest.raises(error, match=field):
        engine.check_options(**options)
    assert engine.health()["status"] == "not started"  # nothing was loaded for a bad request


def test_text_must_be_a_string() -> None:
    engine = OrpheusEngine(EngineConfig(model=None, backend="synthetic", decoder="null"))
    with pytest.raises(TypeError, match="text must be str"):
        engine.synthesize(b"Hello.")  # type: ignore[arg-type]


def test_a_seed_applies_to_sentence_i_as_seed_plus_i_wrapping_below_2_63() -> None:
    config = EngineConfig(model=None, backend="synthetic", decoder="null")
    options = OrpheusEngine(config).check_options(seed=2**63 - 1)
    tokenizer = lambda text: {"input_ids": [ENGLISH.bos, *text.encode()]}  # noqa: E731
    requests = sentence_requests("s", ["Hi."] * 3, options, tokenizer, ENGLISH, config)
    seeds = [request.sampling.seed for request, _ in requests]
    assert seeds == [2**63 - 1, 0, 1]


# ------------------------------------------------------------------ 9. memory


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


async def test_rss_stays_flat_over_a_thousand_interrupted_streams(config: EngineConfig) -> None:
    # The tiny SNAC: what could leak per stream (states, frames, chunks, queues) does not grow with the SNAC's
    # width, and its pooled layer state is allocated once per slot; the full one made this test 190 s a speed.
    # Eight callers at a time, as barge-ins come on a shared engine (and 3× sooner than one at a time).
    async def interrupted(seed: int) -> None:
        stream = engine.synthesize(SIX, seed=seed)
        await stream.__anext__()
        await stream.aclose()

    rss: dict[int, float] = {}
    async with started(config) as engine:
        for done in range(8, 1001, 8):
            await asyncio.gather(*(interrupted(seed) for seed in range(done - 7, done + 1)))
            if done in (200, 1000):
                await until(lambda: engine.stats()["active_streams"] == 0)
                await asyncio.sleep(1.2)  # the idle decoder hands freed memory back (at most once a second)
                rss[done] = _rss_mb()
    assert rss[1000] - rss[200] <= 100, rss


async def test_chunks_name_their_sentence_and_mark_its_end(config: EngineConfig) -> None:
    config = replace(config, sentence_max_chars=40)
    async with started(config) as engine:
        pieces = engine.sentences(SIX)
        chunks = [c async for c in engine.synthesize(SIX, seed=2)]
        alone = [await pcm(engine, p, seed=2 + i) for i, p in enumerate(pieces)]
    assert [c.utterance for c in chunks] == sorted(c.utterance for c in chunks)
    assert [c.utterance for c in chunks if c.utterance_end] == list(range(len(pieces)))
    for i, expected in enumerate(alone):
        got = np.frombuffer(b"".join(c.pcm for c in chunks if c.utterance == i), "<i2")
        assert max_diff(got, expected) <= 2
    assert chunks[-1].final and chunks[-1].utterance_end
