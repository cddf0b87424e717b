"""The engine through its public API: streaming, exactness, batching, cancellation, input, limits."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, EngineError, EngineOverloadedError, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.spec import ENGLISH, SAMPLE_RATE, SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.replay import replay_offline
from tests.stubs import SPEED_IDS, SPEEDS, GatedBackend

TEXT = "Hello there. How are you today?"


@contextlib.contextmanager
def running(config: EngineConfig, **kwargs: object) -> Iterator[OrpheusEngine]:
    engine = OrpheusEngine(config, **kwargs)
    asyncio.run(engine.start())
    try:
        yield engine
    finally:
        asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def engine(synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    with running(synthetic_config) as eng:
        yield eng


@pytest.fixture(scope="module", params=list(SPEEDS.values()), ids=SPEED_IDS)
def paced(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    """Synthetic tokens as fast as they come, and at 300/s a stream (about 3.6x real time)."""
    with running(replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param))) as eng:
        yield eng


@pytest.fixture(params=list(SPEEDS.values()), ids=SPEED_IDS)
def speed(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> EngineConfig:
    """The synthetic config at each generation speed."""
    return replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param))


@pytest.fixture(scope="module")
def hf_engine(hf_config: EngineConfig) -> Iterator[OrpheusEngine]:
    with running(hf_config) as eng:
        yield eng


async def _collect(engine: OrpheusEngine, text: str = TEXT, **kwargs: object) -> list:
    return [chunk async for chunk in engine.synthesize(text, **kwargs)]


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _pcm(chunks: list) -> np.ndarray:
    return np.frombuffer(b"".join(c.pcm for c in chunks), dtype="<i2")


async def test_synthesize_streams_contiguous_24k_chunks_ending_final(engine: OrpheusEngine) -> None:
    chunks = await _collect(engine, voice="leo")
    assert all(c.sample_rate == SAMPLE_RATE for c in chunks)
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    starts = np.cumsum([0] + [c.num_samples for c in chunks[:-1]])
    assert [c.start_sample for c in chunks] == starts.tolist()
    audio = _pcm(chunks)
    assert audio.size > 0 and audio.size % SAMPLES_PER_FRAME == 0
    assert engine.stats()["active_streams"] == 0


async def test_first_chunk_comes_after_28_tokens_with_3435_samples(engine: OrpheusEngine) -> None:
    chunks = await _collect(engine)
    assert chunks[0].num_samples == 4 * SAMPLES_PER_FRAME - 4757 >= 3400


async def test_utterance_edges_are_faded(engine: OrpheusEngine) -> None:
    audio = _pcm(await _collect(engine)).astype(int)
    assert audio[0] == 0 and audio[-1] == 0
    assert np.abs(audio[:240]).max() < np.abs(audio[240:-240]).max()
    assert (np.abs(audio[:240]) <= np.arange(240) / 240 * 32767 + 1).all()


async def test_empty_or_whitespace_text_yields_no_audio(engine: OrpheusEngine) -> None:
    assert await _collect(engine, "") == []
    assert await _collect(engine, "  \n\t\x00 ") == []


def test_unknown_voice_raises_naming_the_valid_voices(engine: OrpheusEngine) -> None:
    with pytest.raises(ValueError, match="valid voices: tara, leah"):
        engine.synthesize("Hi", voice="darth")
    with pytest.raises(ValueError, match="top_p"):
        engine.synthesize("Hi", top_p=0.0)


def test_a_text_over_the_engine_limit_is_refused_at_once_naming_the_limit(engine: OrpheusEngine) -> None:
    started = engine.stats()["streams_started"]
    limit = engine.config.max_text_chars
    with pytest.raises(ValueError, match=f"text of {limit + 1} characters is over the engine's limit of {limit} "):
        engine.synthesize("x" * (limit + 1))
    assert engine.stats()["streams_started"] == started  # refused before anything started


async def test_a_text_at_the_limit_is_spoken_and_none_lifts_the_limit(speed: EngineConfig) -> None:
    text = "Hello there, how are you? " * 4  # 104 characters
    short = replace(speed, synthetic=replace(speed.synthetic, frames_per_prompt_token=0.0))  # min_frames a sentence
    at_limit = OrpheusEngine(replace(short, max_text_chars=len(text)))
    unlimited = OrpheusEngine(replace(short, max_text_chars=None))
    try:
        assert _pcm(await _collect(at_limit, text)).size > 0
        with pytest.raises(ValueError, match="limit of 104"):
            at_limit.synthesize(text + "!")
        assert _pcm(await _collect(unlimited, text * 40)).size > 0  # 4,160: over the default
    finally:
        await asyncio.gather(at_limit.aclose(), unlimited.aclose())


class _Recording(SyntheticBackend):
    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[str] = []

    def generate(self, req):  # type: ignore[no-untyped-def]
        self.prompts.append(bytes(req.prompt_ids[2:-4]).decode())
        return super().generate(req)


async def test_long_text_is_split_and_spoken_in_order_in_one_stream(synthetic_config: EngineConfig) -> None:
    sentences = [f"Sentence {i} is here to make this text long, long, long enough to split." for i in range(9)]
    backend = _Recording()
    config = replace(synthetic_config, sentence_max_chars=160)
    engine = OrpheusEngine(config, backend=backend)
    try:
        chunks = await _collect(engine, " ".join(sentences), voice="zoe")
    finally:
        await engine.aclose()
    assert len(backend.prompts) > 2
    assert all(p.startswith("zoe: ") for p in backend.prompts)
    assert " ".join(p[5:] for p in backend.prompts) == " ".join(sentences)
    assert sum(c.final for c in chunks) == 1 and chunks[-1].final
    assert engine.stats()["utterances"] == len(backend.prompts)


async def test_bad_ids_are_counted_and_decoding_resumes(synthetic_config: EngineConfig) -> None:
    config = replace(synthetic_config, synthetic=SyntheticConfig(fault_every=10))
    engine = OrpheusEngine(config)
    try:
        chunks = await _collect(engine)
    finally:
        await engine.aclose()
    stats = engine.stats()
    assert stats["invalid_non_audio_id"] > 0
    assert stats["frames"] > 0 and chunks[-1].final
    assert _pcm(chunks).size == stats["frames"] * SAMPLES_PER_FRAME


async def test_live_streams_are_decoded_in_shared_batched_calls(paced: OrpheusEngine) -> None:
    before = paced.stats()
    await asyncio.gather(*(_collect(paced, seed=i) for i in range(8)))
    after = paced.stats()
    calls = after["decoder_calls"] - before["decoder_calls"]
    rows = after["decoded_rows"] - before["decoded_rows"]
    assert rows >= 3 * calls  # most calls carry several streams, not one call per stream


LONG = "This sentence runs on for a while, so that its audio lasts several seconds at least, as a long answer does."


async def test_a_stream_ahead_of_real_time_is_decoded_several_frames_a_call_with_the_same_audio(
    speed: EngineConfig,
) -> None:
    heard = {}
    for ahead in (None, 0.0):
        engine = OrpheusEngine(replace(speed, decode_ahead_s=ahead))
        await engine.start()
        try:
            chunks = await _collect(engine, LONG, voice="tara", seed=5)
        finally:
            await engine.aclose()
        heard[ahead] = (_pcm(chunks), [c.num_samples for c in chunks], engine.stats())
    assert heard[None][0].size == heard[0.0][0].size
    assert np.abs(heard[None][0].astype(int) - heard[0.0][0].astype(int)).max() <= 2  # float rounding only
    held_sizes = heard[0.0][1][1:-1]  # past the first chunk, before the utterance's end
    assert 4 * SAMPLES_PER_FRAME in held_sizes  # frames waited to be decoded four at a time
    assert heard[0.0][2]["decoder_calls"] <= heard[None][2]["decoder_calls"]


def _stalling(speed: EngineConfig) -> EngineConfig:
    """Endless utterances (only `max_tokens` ends them) and a small unread-audio bound: a stall is quick to reach."""
    endless = replace(speed.synthetic, endless=True)
    return replace(speed, pause_unread_s=0.5, synthetic=endless, token_budget_per_char=1000.0)


async def test_a_caller_that_stops_reading_pauses_its_generation_until_it_reads_again(speed: EngineConfig) -> None:
    engine = OrpheusEngine(_stalling(speed))
    await engine.start()
    try:
        log: list[int] = []
        stalled = engine.synthesize(LONG, voice="tara", seed=5, token_log=log, max_tokens=50_000)
        await stalled.__anext__()  # then it reads nothing
        await _until(lambda: engine.stats()["backend"]["paused_requests"] == 1)
        assert engine.stats()["generation_pauses"] == 1
        tokens = len(log)
        others = await asyncio.gather(*(_collect(engine, LONG, seed=i, max_tokens=140) for i in range(2)))
        assert all(c[-1].final for c in others) and len(log) == tokens  # steps went by, none for the stalled stream
        deadline = time.monotonic() + 10.0
        async for _ in stalled:  # reading again resumes it
            if len(log) > tokens or time.monotonic() > deadline:
                break
        assert len(log) > tokens
        await stalled.aclose()
        await _until(lambda: engine.stats()["backend"]["live_requests"] == 0)
        assert engine.stats()["backend"]["paused_requests"] == 0
    finally:
        await engine.aclose()


async def test_a_caller_that_leaves_while_its_generation_is_paused_frees_its_row(speed: EngineConfig) -> None:
    engine = OrpheusEngine(_stalling(speed))
    await engine.start()
    try:
        stalled = engine.synthesize(LONG, seed=5, max_tokens=50_000)
        await stalled.__anext__()
        await _until(lambda: engine.stats()["backend"]["paused_requests"] == 1)
        await stalled.aclose()
        await _until(lambda: engine.stats()["active_streams"] == 0 and engine.stats()["backend"]["live_requests"] == 0)
        assert engine.stats()["backend"]["paused_requests"] == 0
        assert (await _collect(engine, max_tokens=140))[-1].final
    finally:
        await engine.aclose()


async def test_random_cancels_of_16_streams_abort_at_once(paced: OrpheusEngine) -> None:
    rng = random.Random(7)
    received: dict[int, int] = {}

    async def listener(i: int, stop_after: int) -> None:
        received[i] = 0
        async for _chunk in paced.synthesize(TEXT * 3, seed=i):
            received[i] += 1
            if received[i] == stop_after:
                break

    tasks = []
    for i in range(16):
        mode = rng.choice(["break", "cancel", "finish"])
        tasks.append(asyncio.create_task(listener(i, rng.randint(1, 3) if mode == "break" else -1)))
        if mode == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0.05, 0.4), tasks[-1].cancel)
    await asyncio.gather(*tasks, return_exceptions=True)
    await _until(lambda: paced.stats()["active_streams"] == 0)
    backend = paced.stats()["backend"]
    await _until(lambda: paced.stats()["backend"]["live_requests"] == 0)
    assert backend["max_steps_to_abort"] <= 1
    assert paced.stats()["streams_cancelled"] > 0
    frames = paced.stats()["decoded_frames"]
    await asyncio.sleep(0.2)
    assert paced.stats()["decoded_frames"] == frames  # nothing of a closed stream is decoded later


async def test_a_closed_stream_delivers_nothing_more(paced: OrpheusEngine) -> None:
    stream = paced.synthesize(TEXT)
    first = await anext(stream)
    await stream.aclose()
    assert first.num_samples > 0
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    await _until(lambda: paced.stats()["active_streams"] == 0)


def test_three_event_loops_in_three_threads_share_one_engine(engine: OrpheusEngine) -> None:
    texts = ["One two three.", "A longer sentence for the second thread to speak.", "Third."]
    expected = [_pcm(asyncio.run(_collect(engine, t, seed=i))) for i, t in enumerate(texts)]
    results: list[np.ndarray | None] = [None] * 3

    def worker(i: int) -> None:
        results[i] = _pcm(asyncio.run(_collect(engine, texts[i], seed=i)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got, want in zip(results, expected):
        assert got is not None and got.size == want.size
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 2  # batched vs alone: float rounding


async def test_admission_is_limited_to_max_streams(speed: EngineConfig) -> None:
    config = replace(speed, max_streams=1)
    backend = GatedBackend(config.synthetic, after=7 * 8)
    engine = OrpheusEngine(config, backend=backend)
    try:
        first = engine.synthesize("Please hold. " + TEXT)
        await anext(first)
        assert engine.load == 1.0
        with pytest.raises(EngineOverloadedError):
            await anext(engine.synthesize(TEXT))
        await first.aclose()
        await _until(lambda: engine.stats()["active_streams"] == 0)
        backend.gate.set()
        assert (await _collect(engine, "Again."))[-1].final
    finally:
        await engine.aclose()


class _SlowStart(SyntheticBackend):
    """Synthetic tokens; `start()` waits for `gate`, and fails the first `failures` times (a busy GPU)."""

    def __init__(self, config: SyntheticConfig, failures: int = 0):
        super().__init__(config)
        self.gate = threading.Event()
        self.failures = failures

    async def start(self) -> None:
        await asyncio.to_thread(self.gate.wait)
        if self.failures:
            self.failures -= 1
            raise OSError("CUDA out of memory (the GPU is busy)")
        await super().start()


async def test_a_cancelled_start_never_cancels_the_shared_load(speed: EngineConfig) -> None:
    backend = _SlowStart(speed.synthetic)
    engine = OrpheusEngine(speed, backend=backend)
    try:
        waiting = asyncio.create_task(engine.start())
        await _until(lambda: engine.health()["status"] == "starting")
        waiting.cancel()  # a job that ends while the engine loads
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.start(), 0.05)  # a caller's own deadline
        assert engine.health() == {"status": "starting", "reason": "loading"}
        backend.gate.set()
        await engine.start()
        assert engine.health()["status"] == "ok" and engine.started
        assert (await _collect(engine))[-1].final
    finally:
        backend.gate.set()
        await engine.aclose()


async def test_a_failed_start_is_tried_again_by_the_next_start(speed: EngineConfig) -> None:
    backend = _SlowStart(speed.synthetic, failures=1)
    backend.gate.set()
    engine = OrpheusEngine(speed, backend=backend)
    try:
        with pytest.raises(EngineError, match="CUDA out of memory"):
            await engine.start()
        assert engine.health()["status"] == "failed" and not engine.started
        await engine.start()
        assert engine.health()["status"] == "ok"
        assert (await _collect(engine))[-1].final
    finally:
        await engine.aclose()


async def test_closing_an_engine_while_it_loads_waits_for_the_load_and_stops_it(speed: EngineConfig) -> None:
    backend = _SlowStart(speed.synthetic)
    engine = OrpheusEngine(speed, backend=backend)
    engine.prewarm()
    closing = asyncio.create_task(engine.aclose())
    await _until(lambda: engine.health()["status"] == "closed")
    backend.gate.set()
    await closing
    assert engine.health()["status"] == "closed"
    with pytest.raises(EngineError):
        await engine.start()


def test_one_shared_engine_per_config(synthetic_config: EngineConfig) -> None:
    a = OrpheusEngine.shared(synthetic_config)
    assert OrpheusEngine.shared(synthetic_config) is a
    assert OrpheusEngine.shared(replace(synthetic_config, max_streams=3)) is not a


# ---------------------------------------------------------------- the full stack on the test model


async def test_hf_engine_audio_equals_offline_decode_of_its_tokens(hf_engine: OrpheusEngine, test_model_dir) -> None:
    log: list[int] = []
    before = hf_engine.stats()
    chunks = await _collect(hf_engine, "Hi. <laugh> Short one.", voice="tara", seed=3, token_log=log)
    streamed = _pcm(chunks)
    offline = replay_offline(load_snac(str(test_model_dir / "snac")), np.array(log), ENGLISH)
    assert streamed.size == offline.size > 0
    assert np.abs(streamed.astype(int) - offline.astype(int)).max() <= 33
    after = hf_engine.stats()
    assert not any(k.startswith("invalid_") for k in after)  # phase-aware sampling: only valid frames
    assert after["finish_budget"] > before.get("finish_budget", 0)  # the random model never stops itself


async def test_hf_engine_max_tokens_caps_generation(hf_engine: OrpheusEngine) -> None:
    before = hf_engine.stats().get("finish_max_tokens", 0)
    chunks = await _collect(hf_engine, "Capped.", max_tokens=70, seed=1)
    assert _pcm(chunks).size == 10 * SAMPLES_PER_FRAME
    assert hf_engine.stats()["finish_max_tokens"] == before + 1


async def test_hf_engine_cancel_aborts_within_one_step(hf_engine: OrpheusEngine) -> None:
    async for _chunk in hf_engine.synthesize(TEXT * 4, seed=2):
        break
    await _until(lambda: hf_engine.stats()["active_streams"] == 0)
    await _until(lambda: hf_engine.stats()["backend"]["live_requests"] == 0)
    assert hf_engine.stats()["backend"]["max_steps_to_abort"] <= 1


async def test_closing_the_engine_ends_open_streams_with_an_error(speed: EngineConfig) -> None:
    from orpheus_tts_plugin import EngineError

    engine = OrpheusEngine(speed, backend=GatedBackend(speed.synthetic, after=7 * 8))
    stream = engine.synthesize("Please hold. " + TEXT * 3)
    await anext(stream)
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        async for _chunk in stream:
            pass
    assert engine.stats()["active_streams"] == 0
    with pytest.raises(EngineError):
        await anext(engine.synthesize("After close."))
