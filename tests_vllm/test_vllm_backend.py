"""The vllm backend on a real vLLM (its CPU build), with the backend's default options: one AsyncLLM for the module.

Generation speed: vLLM on these 2 CPU cores streams this model at roughly 60-300 tokens/s in all, slower than the
decoder consumes them; a run "faster than decoding" needs a GPU, so these tests run at the natural speed only.
Nothing here depends on timing: every wait has a hang guard only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import invalid_positions

from orpheus_tts_plugin.backends.protocol import FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.vllm import MIN_VLLM, VllmBackend, VllmStream, import_vllm, parse_version
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
PROMPT = (SPEC.start_of_human, SPEC.bos, 300, 301, 302, 303, 304, 305, *SPEC.prompt_suffix())
GUARD_S = 120  # a hang guard, never a speed expectation


def request(rid: str, max_new: int, *, seed: int | None = 1, temperature: float = 0.6, constrain: bool = True,
            stop: tuple[int, ...] = (SPEC.end_of_speech,)) -> GenerationRequest:  # fmt: skip
    sampling = SamplingParams(temperature=temperature, top_p=0.8, repetition_penalty=1.1, seed=seed)
    return GenerationRequest(rid, PROMPT, sampling, max_new, stop, constrain)


async def run(backend: VllmBackend, req: GenerationRequest) -> tuple[list[int], str | None]:
    """All ids of one request and its finish reason."""
    stream = backend.generate(req)

    async def collect() -> list[int]:
        return [i async for ids in stream for i in ids]

    ids = await asyncio.wait_for(collect(), GUARD_S)
    return ids, stream.finish_reason


@pytest.fixture(scope="module")
async def backend(test_model_dir: Path):
    """The backend with its default options (CPU: eager, fp32, no quantisation, the audio processor)."""
    b = VllmBackend(str(test_model_dir / "orpheus"))
    await b.start()
    yield b
    await b.close()


def test_the_installed_vllm_is_at_least_the_minimum_version() -> None:
    import vllm

    import_vllm()
    assert parse_version(vllm.__version__) >= MIN_VLLM == (0, 10, 2)


async def test_the_default_options_start_on_the_cpu_build(backend: VllmBackend) -> None:
    args = backend.engine_args()
    assert backend.on_cpu() and (args.enforce_eager, args.dtype) == (True, "float32")
    assert (args.quantization, args.kv_cache_dtype) == (None, "auto")
    assert args.logits_processors == ["orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor"]
    ids, finish = await run(backend, request("start", 14))
    assert len(ids) == 14 and finish == FinishReason.LENGTH


async def test_every_constrained_id_is_valid_at_its_frame_position(backend: VllmBackend) -> None:
    reqs = [request(f"c{i}", 140, seed=i) for i in range(4)]
    results = await asyncio.gather(*(run(backend, r) for r in reqs))
    assert all(finish in (FinishReason.LENGTH, FinishReason.STOP) for _, finish in results)
    assert sum(len(ids) for ids, _ in results) > 7 * 4
    assert [invalid_positions(ids) for ids, _ in results] == [0, 0, 0, 0]


async def test_the_constraint_applies_only_to_requests_that_ask_for_it(backend: VllmBackend) -> None:
    (on, _), (off, _) = await asyncio.gather(
        run(backend, request("on", 70, seed=3)), run(backend, request("off", 70, seed=3, constrain=False))
    )
    assert invalid_positions(on) == 0
    assert invalid_positions(off) > 0  # the random model, unconstrained, almost never hits the right position


async def test_seeded_requests_repeat_and_other_seeds_differ(backend: VllmBackend) -> None:
    reqs = [request("s7a", 70, seed=7), request("s7b", 70, seed=7), request("s8", 70, seed=8)]
    (a, _), (b, _), (c, _) = await asyncio.gather(*(run(backend, r) for r in reqs))
    assert a == b != c


async def test_a_stop_id_ends_the_request_with_stop_and_is_not_delivered(backend: VllmBackend) -> None:
    greedy, finish = await run(backend, request("g", 30, temperature=0.0))
    assert finish == FinishReason.LENGTH and len(greedy) == 30
    stop_id = greedy[10]
    ids, finish = await run(backend, request("gs", 30, temperature=0.0, stop=(SPEC.end_of_speech, stop_id)))
    assert finish == FinishReason.STOP and ids == greedy[: greedy.index(stop_id)]


async def test_closing_a_stream_aborts_it_in_vllm_at_once(backend: VllmBackend) -> None:
    stream = backend.generate(request("long", 3000, temperature=1.0))
    for _ in range(3):
        assert await asyncio.wait_for(stream.__anext__(), GUARD_S)
    assert backend.stats()["vllm_unfinished_requests"] == 1
    await stream.aclose()
    assert backend.stats()["vllm_unfinished_requests"] == 0  # gone from vLLM when aclose returns
    assert stream.finish_reason == FinishReason.ABORTED
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert backend.stats()["live_requests"] == 0
    ids, _ = await run(backend, request("after", 7))  # the engine serves on
    assert len(ids) == 7


async def unfinished(backend: VllmBackend, n: int) -> None:
    """Wait until vLLM holds `n` requests (an abort runs in a task); fails only if that never comes (a hang guard)."""

    async def wait() -> None:
        while backend.stats()["vllm_unfinished_requests"] != n:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), GUARD_S)


async def paused_mid_frame(backend: VllmBackend, stream: VllmStream, at_least: int) -> list[int]:
    """Ids of `stream` until it has generated `at_least` and sits mid-frame, then paused; its request has left vLLM."""
    ids: list[int] = []
    while stream.generated < at_least or stream.generated % 7 == 0:
        ids += await asyncio.wait_for(stream.__anext__(), GUARD_S)
    stream.pause(True)  # no await between the check and the pause: `generated` is where it resumes
    await unfinished(backend, 0)
    assert backend.stats()["paused_requests"] == 1
    return ids


async def test_a_greedy_stream_paused_and_resumed_mid_frame_gives_the_ids_of_one_never_paused(
    backend: VllmBackend,
) -> None:
    whole, finish = await run(backend, request("whole", 40, temperature=0.0))
    assert finish == FinishReason.LENGTH and len(whole) == 40
    stream = backend.generate(request("paused", 40, temperature=0.0))
    ids = await paused_mid_frame(backend, stream, 10)
    offset = stream.generated
    assert offset % 7 != 0
    stream.pause(False)
    ids += await asyncio.wait_for(_rest(stream), GUARD_S)
    assert stream.attempt.request_id == "paused~1" and len(stream.attempt.prompt_ids) == len(PROMPT) + offset
    assert ids == whole and stream.finish_reason == FinishReason.LENGTH
    stats = backend.stats()
    assert stats["paused_requests"] == 0 and stats["live_requests"] == 0 and stats["vllm_unfinished_requests"] == 0


async def test_a_paused_stream_leaves_vllm_then_resumes_and_ends_at_its_stop_id(backend: VllmBackend) -> None:
    """Ends the way end of speech ends a request (a stop id): the random model rarely picks end of speech itself."""
    greedy, _ = await run(backend, request("plain", 40, temperature=0.0))
    end = next(i for i in range(20, 40) if greedy[i] not in greedy[:i])  # an id first seen after the pause
    before = backend.stats()
    stream = backend.generate(request("stops", 40, temperature=0.0, stop=(SPEC.end_of_speech, greedy[end])))
    ids = await paused_mid_frame(backend, stream, 12)
    stream.pause(False)
    ids += await asyncio.wait_for(_rest(stream), GUARD_S)
    assert stream.finish_reason == FinishReason.STOP and ids == greedy[:end]
    after = backend.stats()
    assert after["requests"] - before["requests"] == 1  # one logical request, counted once
    assert (after["pauses"] - before["pauses"], after["resumes"] - before["resumes"]) == (1, 1)


async def test_a_sampled_stream_resumed_mid_frame_keeps_every_id_at_its_frame_position(backend: VllmBackend) -> None:
    stream = backend.generate(request("sampled", 70, seed=5))
    ids = await paused_mid_frame(backend, stream, 10)
    for at in (24, 45):  # three attempts in all, each resumed mid-frame
        stream.pause(False)
        ids += await paused_mid_frame(backend, stream, at)
    stream.pause(False)
    ids += await asyncio.wait_for(_rest(stream), GUARD_S)
    assert stream.attempt.request_id == "sampled~3"
    assert len(ids) == 70 and invalid_positions(ids) == 0 and stream.finish_reason == FinishReason.LENGTH


async def _rest(stream: VllmStream) -> list[int]:
    return [i async for ids in stream for i in ids]


async def test_close_aborts_live_requests_and_shuts_vllm_down(backend: VllmBackend) -> None:
    """Last in the module: it shuts the shared engine down (the fixture's close is then a no-op)."""
    streams = [backend.generate(request(f"live{i}", 3000, temperature=1.0)) for i in range(2)]

    async def consume(stream) -> int:
        return sum([len(ids) async for ids in stream])

    for s in streams:  # both are generating
        assert await asyncio.wait_for(s.__anext__(), GUARD_S)
    consumers = [asyncio.create_task(consume(s)) for s in streams]
    await asyncio.wait_for(backend.close(), GUARD_S)
    counts = await asyncio.wait_for(asyncio.gather(*consumers), GUARD_S)  # no consumer is left waiting
    assert [s.finish_reason for s in streams] == [FinishReason.ABORTED, FinishReason.ABORTED]
    assert all(n < 3000 for n in counts)
    assert backend.stats()["live_requests"] == 0 and backend.stats()["aborted"] >= 2
