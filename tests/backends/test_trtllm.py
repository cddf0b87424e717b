"""TensorRT-LLM backend against stand-ins of TensorRT-LLM 1.2 and >= 1.3 (tests/trtllm_standin/).

TensorRT-LLM never ran in this project (no CUDA, wheel only on NVIDIA's index). Each stand-in follows the upstream
code of its line on the points this backend depends on, and names it: the sampler `sampler_type` selects or
rejects, penalties and seeds, the embedding bias per step, logits processors one step late under the overlap
scheduler, the request path into the worker (pickled), the request queue and its silent aborts, finish reasons.
Tests marked for one line are about what differs; the rest run on both.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from orpheus_tts_plugin.backends.protocol import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.pumped import continuation_seed
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH, TOKENS_PER_FRAME
from tests.trtllm_standin import LLM, CudaGraphConfig, KvCacheConfig, install

SPEC = ENGLISH
AUDIO = [SPEC.audio_token(0, 5), SPEC.audio_token(1, 6), SPEC.audio_token(2, 7), SPEC.audio_token(3, 8)]


@pytest.fixture(params=["1.2", "1.3"])
def trt(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The stand-in of each line in turn."""
    return install(monkeypatch, request.param)


@pytest.fixture
def trt12(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install(monkeypatch, "1.2")


@pytest.fixture
def trt13(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install(monkeypatch, "1.3")


def checkpoint(root: Path, *, kv: str | None = None, vocab: int = SPEC.vocab_size) -> str:
    """A local checkpoint: config.json, and hf_quant_config.json with a calibrated KV cache if `kv`."""
    root.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"vocab_size": vocab}
    if kv is not None:
        config["quantization_config"] = {"quant_method": "modelopt", "kv_cache_quant_algo": kv}
        modelopt = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": kv}}
        (root / "hf_quant_config.json").write_text(json.dumps(modelopt))
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.fixture
def model(tmp_path: Path) -> str:
    """An FP8 checkpoint as `orpheus-tts quantize` writes it (calibrated FP8 KV cache)."""
    return checkpoint(tmp_path / "orpheus-fp8", kv="FP8")


def request(
    rid: str = "r1",
    *,
    constrain: bool = True,
    max_new: int = 700,
    seed: int | None = 7,
    temperature: float = 0.6,
    stop: tuple[int, ...] = (SPEC.end_of_speech,),
) -> GenerationRequest:
    prompt = (SPEC.start_of_human, SPEC.bos, 1234, 56, 789, *SPEC.prompt_suffix())
    sampling = SamplingParams(temperature=temperature, top_p=0.8, repetition_penalty=1.1, max_tokens=6144, seed=seed)
    return GenerationRequest(rid, prompt, sampling, max_new, stop, constrain)


async def started(model: str, **kwargs: Any):
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    backend = TrtllmBackend(model, **kwargs)
    await backend.start()
    return backend, LLM.instances[-1]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _collect(stream) -> list[list[int]]:
    return [ids async for ids in stream]


async def take(stream, n: int, llm: LLM) -> list[int]:
    """The next `n` ids of `stream`, running one executor iteration per id."""
    out: list[int] = []
    while len(out) < n:
        llm.iterate()
        out += await asyncio.wait_for(stream.__anext__(), 2.0)
    return out


async def to_the_end(stream, llm: LLM, limit: int = 1000) -> list[int]:
    """Every id `stream` has left, running one executor iteration per id, until it ends."""
    out: list[int] = []
    for _ in range(limit):
        llm.iterate()
        try:
            out += await asyncio.wait_for(stream.__anext__(), 2.0)
        except StopAsyncIteration:
            return out
    raise AssertionError(f"no end after {limit} iterations")


async def seeded_ids(model: str, seeds: list[int], n: int = 12) -> list[list[int]]:
    """`n` ids of one stream per seed, all in one batch of one fresh backend (unconstrained, temperature 1)."""
    backend, llm = await started(model)
    streams = [
        backend.generate(request(f"s{i}", seed=s, temperature=1.0, constrain=False)) for i, s in enumerate(seeds)
    ]
    ids = [await take(s, n, llm) for s in streams]
    for s in streams:
        await s.aclose()
    await backend.close()
    return ids


def positions(ids: list[int]) -> list[int]:
    """The frame position each audio id encodes."""
    return [(i - SPEC.first_audio_token) // 4096 for i in ids]


# ---- import, version, which line ----


def test_import_guard_says_how_to_get_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    import orpheus_tts_plugin.backends.trtllm as mod  # the module itself imports without TensorRT-LLM

    with pytest.raises(ImportError) as info:
        mod.TrtllmBackend("/models/x")
    message = str(info.value)
    assert "pypi.nvidia.com" in message and "nvcr.io/nvidia/tensorrt-llm/release:1.2" in message


def test_a_tensorrt_llm_older_than_1_2_is_refused(trt12) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    trt12.__version__ = "1.1.0"
    with pytest.raises(ImportError, match="found TensorRT-LLM 1.1.0"):
        TrtllmBackend("/models/x")


async def test_on_1_2_the_llm_uses_trtllm_sampler(trt12, model) -> None:
    backend, llm = await started(model)
    assert llm.kwargs["sampler_type"] == "TRTLLMSampler" and llm.sampler.name == "TRTLLMSampler"
    assert backend.stats()["sampler"] == "TRTLLMSampler" and backend.stats()["seeds"] == "per-request"
    await backend.close()


async def test_on_1_3_no_sampler_type_is_sent_and_torch_sampler_runs(trt13, model) -> None:
    backend, llm = await started(model)
    assert "sampler_type" not in llm.kwargs and llm.sampler.name == "TorchSampler"
    assert backend.stats()["sampler"] == "TorchSampler" and backend.stats()["seeds"] == "best-effort"
    await backend.close()


async def test_on_1_3_asking_for_trtllm_sampler_is_rejected_by_tensorrt_llm(trt13, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    backend = TrtllmBackend(model, llm_kwargs={"sampler_type": "TRTLLMSampler"})  # the caller's own choice
    with pytest.raises(ValueError, match="TRTLLMSampler"):
        await backend.start()


async def test_a_1_3_candidate_that_still_has_trtllm_sampler_uses_torch_sampler_once_it_penalises(
    monkeypatch, model
) -> None:
    install(monkeypatch, "1.3rc")  # TRTLLMSampler deprecated (#11938) but not yet removed (#18232)
    backend, llm = await started(model)
    assert "sampler_type" not in llm.kwargs and llm.sampler.name == "TorchSampler"
    assert backend.stats()["sampler"] == "TorchSampler"
    await backend.close()


def test_a_tensorrt_llm_whose_samplers_cannot_penalise_is_refused_unless_a_sampler_is_chosen(
    trt13, model, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    monkeypatch.delitem(sys.modules, "tensorrt_llm._torch.pyexecutor.sampler.penalties")  # no penalties, no TRTLLM
    with pytest.raises(ImportError, match="neither TRTLLMSampler nor a TorchSampler that applies repetition_penalty"):
        TrtllmBackend(model)
    backend = TrtllmBackend(model, llm_kwargs={"sampler_type": "TorchSampler"})
    assert backend.llm_args()["sampler_type"] == "TorchSampler" and backend.stats()["seeds"] == "best-effort"


# ---- penalties and seeds ----


async def test_on_1_2_seeded_requests_repeat_even_when_batched_together(trt12, model) -> None:
    a, b, c = await seeded_ids(model, [7, 7, 8])
    assert a == b != c  # TorchSampler's one shared generator would give a != b


async def test_on_1_3_a_seeded_stream_repeats_alone_but_not_beside_another_with_the_same_seed(trt13, model) -> None:
    (alone,) = await seeded_ids(model, [7])
    (again,) = await seeded_ids(model, [7])
    first, second = await seeded_ids(model, [7, 7])
    assert alone == again == first  # alone, or the first row of its sampling group: reproducible
    assert second != first  # sampler/seed_manager.py: "only the first row's seed applies" (documented: best-effort)


@pytest.mark.parametrize("line", ["1.2", "1.3"])
async def test_the_repetition_penalty_takes_effect(line, monkeypatch, model) -> None:
    install(monkeypatch, line)
    backend, llm = await started(model, audio_constraint="union")
    stream = backend.generate(request(temperature=0.0))  # greedy, repetition_penalty 1.1
    ids = await take(stream, 6, llm)
    assert len(set(ids)) == 6  # unpenalised greedy would repeat the top id six times
    await stream.aclose()


# ---- the audio constraint ----


@pytest.mark.parametrize(
    ("line", "batch", "expected"),
    [
        ("1.2", 256, "union"),  # TRTLLMSampler: the bias costs nothing per step; the processor ~26 ms at 256 rows
        ("1.2", 16, "position"),  # 1.6 ms per step: within the budget
        ("1.3", 256, "position"),  # TorchSampler: 256 bias rows per step cost more than 256 processor calls
        ("1.3", 16, "position"),
    ],
)
def test_the_constraint_follows_its_per_step_host_cost_at_the_configured_batch(
    line, batch, expected, monkeypatch, model
) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    install(monkeypatch, line)
    backend = TrtllmBackend(model, max_batch_size=batch)
    assert backend.audio_constraint == expected and backend.stats()["audio_constraint"] == expected


@pytest.mark.parametrize("overlap", [True, False])
async def test_with_the_position_processor_every_id_is_at_its_frame_position(trt, model, overlap) -> None:
    llm_kwargs = {} if overlap else {"disable_overlap_scheduler": True}
    backend, llm = await started(model, max_batch_size=8, llm_kwargs=llm_kwargs)
    assert backend.audio_constraint == "position" and llm.overlap is overlap
    streams = [backend.generate(request(f"r{i}", temperature=0.0)) for i in range(3)]
    for _ in range(3 * TOKENS_PER_FRAME):
        llm.iterate()
    for s in streams:
        ids = [
            i
            for step in [await asyncio.wait_for(s.__anext__(), 2.0) for _ in range(3 * TOKENS_PER_FRAME)]
            for i in step
        ]
        assert positions(ids) == [k % TOKENS_PER_FRAME for k in range(len(ids))]
        await s.aclose()


async def test_with_the_union_bias_ids_land_at_wrong_positions(trt, model) -> None:
    backend, llm = await started(model, audio_constraint="union")
    stream = backend.generate(request(temperature=0.0))
    ids = await take(stream, TOKENS_PER_FRAME, llm)
    assert all(SPEC.first_audio_token <= i < SPEC.audio_token_end for i in ids)
    assert positions(ids) != list(range(TOKENS_PER_FRAME))  # what the engine counts as invalid_wrong_position
    await stream.aclose()


def test_the_position_processor_counts_its_own_calls_through_a_history_one_step_late() -> None:
    from orpheus_tts_plugin.backends.trtllm_logits import FORBIDDEN, AudioPositionProcessor

    lp = AudioPositionProcessor(SPEC)
    prompt = [1, 2, 3]
    seen: list[int] = []
    for k in range(9):
        logits = torch.zeros((1, 1, SPEC.vocab_size))
        history = [prompt + seen[: max(0, k - 1)]]  # the overlap scheduler's view lacks the previous step's token
        lp(0, logits, history, None, None)
        allowed = torch.nonzero(logits[0, 0] != FORBIDDEN).flatten().tolist()
        assert allowed == sorted(SPEC.allowed_ids(k % TOKENS_PER_FRAME).tolist())
        seen.append(allowed[0])


def test_without_the_overlap_scheduler_the_processor_follows_the_history_through_skipped_and_extra_calls() -> None:
    from orpheus_tts_plugin.backends.trtllm_logits import AudioPositionProcessor

    lp = AudioPositionProcessor(SPEC, overlap=False)
    prompt = [1, 2, 3]
    assert [lp.index([prompt]), lp.index([prompt])] == [0, 0]  # a prompt in two chunks: both calls are index 0
    assert lp.index([[*prompt, 9]]) == 1
    assert lp.index([[*prompt, 9, 9, 9]]) == 3  # a step passed without a call (re-prefill after an eviction)


def test_with_the_overlap_scheduler_a_count_run_ahead_by_a_chunked_prompt_is_back_on_track_next_step() -> None:
    from orpheus_tts_plugin.backends.trtllm_logits import AudioPositionProcessor

    lp = AudioPositionProcessor(SPEC)
    prompt = [1, 2, 3]
    # two context chunks, then generation steps whose history is one token behind
    views = [prompt, prompt, prompt, [*prompt, 9], [*prompt, 9, 9]]
    assert [lp.index([v]) for v in views] == [0, 1, 1, 2, 3]  # only the second chunk's (sampled) row is off


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_prompt_prefilled_in_two_chunks_keeps_the_ids_at_their_positions(trt, model, overlap) -> None:
    llm_kwargs = {} if overlap else {"disable_overlap_scheduler": True}
    backend, llm = await started(model, max_batch_size=8, llm_kwargs=llm_kwargs)
    llm.context_chunks = 2
    stream = backend.generate(request(temperature=0.0))
    llm.iterate()  # the first chunk: its row goes through the processor, nothing is sampled
    ids = await take(stream, 2 * TOKENS_PER_FRAME, llm)
    expected = [k % TOKENS_PER_FRAME for k in range(len(ids))]
    if overlap:  # the first id is constrained as if it were the second: that frame is lost, the rest are right
        assert positions(ids)[1:] == expected[1:] and positions(ids)[0] != 0
    else:
        assert positions(ids) == expected
    await stream.aclose()


def test_a_request_s_processor_crosses_into_the_worker_small_and_with_its_own_count() -> None:
    from orpheus_tts_plugin.backends.trtllm_logits import AudioPositionProcessor

    spec = SPEC
    _ = spec.audio_ids  # cached on the spec: must not ride along
    lp = AudioPositionProcessor(spec)
    blob = pickle.dumps(lp)
    assert len(blob) < 2_000
    copy = pickle.loads(blob)
    copy.index([[1]])
    assert (copy.calls, lp.calls) == (1, 0)


async def test_on_1_2_no_embedding_bias_row_is_copied_from_the_host_per_step(trt12, model) -> None:
    backend, llm = await started(model)
    assert backend.audio_constraint == "union"
    streams = [backend.generate(request(f"r{i}")) for i in range(8)]
    for _ in range(3):
        llm.iterate()
    assert llm.host_bias_bytes_per_step == [0, 0, 0]  # TorchSampler would stack 8 rows of 628 kB every step
    assert llm.sampler.bias_uploads == 8  # once per request, into its decoder slot
    for s in streams:
        await s.aclose()


async def test_on_1_3_a_union_bias_is_one_host_row_per_request_per_step(trt13, model) -> None:
    backend, llm = await started(model, audio_constraint="union")
    streams = [backend.generate(request(f"r{i}")) for i in range(8)]
    assert llm.results[0].sampling_params.embedding_bias is llm.results[1].sampling_params.embedding_bias
    llm.iterate()
    assert llm.host_bias_bytes_per_step == [8 * SPEC.vocab_size * 4]  # pickled into the worker: 8 distinct rows
    for s in streams:
        await s.aclose()


async def test_the_embedding_bias_allows_exactly_audio_ids_and_end(trt, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import FORBIDDEN_BIAS

    backend, llm = await started(model, audio_constraint="union")
    s1, s2 = backend.generate(request("a")), backend.generate(request("b"))
    bias = llm.results[0].sampling_params.embedding_bias
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (SPEC.vocab_size,)
    allowed = torch.nonzero(bias == 0).flatten().tolist()
    assert allowed == [SPEC.end_of_speech, *range(SPEC.first_audio_token, SPEC.audio_token_end)]
    assert torch.all(bias[bias != 0] == FORBIDDEN_BIAS) and FORBIDDEN_BIAS <= -1e4
    assert llm.results[1].sampling_params.embedding_bias is bias  # one shared tensor, not one per request
    s3 = backend.generate(request("c", constrain=False))
    assert llm.results[2].sampling_params.embedding_bias is None
    for s in (s1, s2, s3):
        await s.aclose()
    await backend.close()


@pytest.mark.parametrize("kind", ["union", "position"])
async def test_with_the_constraint_off_neither_bias_nor_processor_is_sent(trt, model, kind) -> None:
    backend, llm = await started(model, constrain_audio=False, audio_constraint=kind)
    stream = backend.generate(request())
    p = llm.results[0].sampling_params
    assert p.embedding_bias is None and p.logits_processor is None and backend.stats()["audio_constraint"] == "none"
    await stream.aclose()


async def test_the_bias_length_follows_the_checkpoint_vocab(trt, tmp_path) -> None:
    backend, llm = await started(checkpoint(tmp_path / "padded", vocab=157_056), audio_constraint="union")
    stream = backend.generate(request())
    bias = llm.results[0].sampling_params.embedding_bias
    assert tuple(bias.shape) == (157_056,) and bias[156_999] < 0 and bias[SPEC.first_audio_token] == 0
    await stream.aclose()


def test_an_unknown_audio_constraint_is_refused_by_name(trt, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    with pytest.raises(ValueError, match="audio_constraint"):
        TrtllmBackend(model, audio_constraint="frames")


# ---- LLM arguments ----


async def test_llm_is_built_with_the_kv_cache_cuda_graphs_and_limits(trt, model) -> None:
    backend, llm = await started(
        model, max_batch_size=128, max_num_tokens=8192, max_seq_len=4096, kv_cache_fraction=0.85
    )
    assert llm.model == model
    kv = llm.kwargs["kv_cache_config"]
    assert isinstance(kv, KvCacheConfig) and kv.free_gpu_memory_fraction == 0.85 and kv.enable_block_reuse
    graphs = llm.kwargs["cuda_graph_config"]
    assert isinstance(graphs, CudaGraphConfig) and graphs.enable_padding and graphs.max_batch_size == 128
    assert (llm.kwargs["max_batch_size"], llm.kwargs["max_num_tokens"], llm.kwargs["max_seq_len"]) == (128, 8192, 4096)
    assert llm.kwargs["enable_chunked_prefill"] is True
    await backend.close()
    assert llm.shut


@pytest.mark.parametrize(
    ("kv", "given", "expected"),
    [
        ("FP8", None, "auto"),  # calibrated: "auto" takes its kv_cache_quant_algo and scales; "fp8" would not
        (None, None, "fp8"),  # no calibrated KV cache: FP8 with unit scales
        ("FP8", "fp8", "fp8"),  # asked for
        (None, "auto", "auto"),
    ],
)
async def test_the_kv_cache_dtype_follows_the_checkpoint(trt, tmp_path, kv, given, expected) -> None:
    _, llm = await started(checkpoint(tmp_path / "m", kv=kv), kv_cache_dtype=given)
    assert llm.kwargs["kv_cache_config"].dtype == expected


async def test_an_unreadable_checkpoint_gets_the_kv_cache_dtype_auto(trt, monkeypatch, tmp_path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _, llm = await started("org/not-cached")
    assert llm.kwargs["kv_cache_config"].dtype == "auto"


async def test_explicit_cuda_graph_batch_sizes_and_extra_llm_kwargs_are_passed(trt, model) -> None:
    backend, llm = await started(
        model, cuda_graph_batch_sizes=[1, 8, 64], llm_kwargs={"disable_overlap_scheduler": True}
    )
    assert llm.kwargs["cuda_graph_config"].batch_sizes == [1, 8, 64]
    assert llm.kwargs["disable_overlap_scheduler"] is True
    await backend.close()


# ---- requests ----


async def test_a_request_is_token_ids_with_end_id_and_sampling_but_no_redundant_stop_id(trt, model) -> None:
    backend, llm = await started(model)
    req = request(max_new=321)
    stream = backend.generate(req)
    assert llm.calls[0] == {"inputs": list(req.prompt_ids), "streaming": True}
    p = llm.results[0].sampling_params
    assert p.end_id == SPEC.end_of_speech == 128258
    assert p.stop_token_ids is None  # end_id ends it already; a stop id per step would be a Python check for nothing
    assert p.detokenize is False and p.max_tokens == 321 and p.pad_id == SPEC.pad
    assert (p.temperature, p.top_p, p.repetition_penalty, p.seed) == (0.6, 0.8, 1.1, 7)
    await stream.aclose()
    await backend.close()


async def test_extra_stop_ids_are_sent_without_the_end_id(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request(stop=(SPEC.end_of_speech, 4242)))
    assert llm.results[0].sampling_params.stop_token_ids == [4242]
    await stream.aclose()


async def test_token_ids_diff_streams_and_the_end_id_is_dropped(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    result = llm.results[0]
    result.step(AUDIO[:2])
    result.step([])
    result.step(AUDIO[2:3])
    result.step([AUDIO[3], SPEC.end_of_speech], "stop")
    got = await asyncio.wait_for(_collect(stream), 2.0)
    assert got == [AUDIO[:2], AUDIO[2:3], AUDIO[3:4]]
    assert stream.finish_reason == FinishReason.STOP
    await stream.aclose()
    assert result.aborts == 0  # a finished request is not aborted
    stats = backend.stats()
    assert stats["live_requests"] == 0 and stats["tokens"] == 4 and stats["requests"] == 1


async def test_the_executor_s_own_length_finish_ends_the_stream_as_length(trt, model) -> None:
    backend, llm = await started(model, max_batch_size=8)
    stream = backend.generate(request(constrain=False, max_new=3))
    await take(stream, 3, llm)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(stream.__anext__(), 2.0)
    assert stream.finish_reason == FinishReason.LENGTH


async def test_a_length_finish_is_reported_as_length(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request(max_new=3))
    llm.results[0].step(AUDIO[:3], "length")
    assert await asyncio.wait_for(_collect(stream), 2.0) == [AUDIO[:3]]
    assert stream.finish_reason == FinishReason.LENGTH


async def test_a_timeout_finish_fails_the_stream_with_a_typed_timeout_error(trt, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmTimeoutError

    backend, llm = await started(model)
    stream = backend.generate(request())
    llm.results[0].step(AUDIO[:2])
    llm.results[0].step(AUDIO[2:3], "timeout")  # executor/result.py: tllm.FinishReason.TIMED_OUT → 'timeout'
    assert await asyncio.wait_for(stream.__anext__(), 2.0) == AUDIO[:2]
    assert await asyncio.wait_for(stream.__anext__(), 2.0) == AUDIO[2:3]
    with pytest.raises(TrtllmTimeoutError, match="timed out request r1"):
        await asyncio.wait_for(stream.__anext__(), 2.0)
    assert isinstance(TrtllmTimeoutError("x"), BackendError)
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_an_unknown_finish_reason_fails_the_stream_naming_it(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    llm.results[0].step([], "not_finished")
    with pytest.raises(BackendError, match="'not_finished'"):
        await asyncio.wait_for(stream.__anext__(), 2.0)


# ---- aborts ----


async def test_closing_an_active_stream_aborts_the_request(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    assert len(await take(stream, 2, llm)) == 2
    await stream.aclose()
    result = llm.results[0]
    assert result.aborts == 1 and stream.finish_reason == FinishReason.ABORTED
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    llm.iterate()  # the executor finishes it "cancelled" at its next iteration; nothing reaches the consumer
    assert llm.active == []
    await stream.aclose()
    assert result.aborts == 1
    assert backend.stats()["aborted"] == 1 and backend.stats()["live_requests"] == 0


async def test_closing_a_queued_stream_ends_its_waiting_consumer(trt, model) -> None:
    backend, llm = await started(model, max_batch_size=1)
    first = backend.generate(request("first"))
    queued = backend.generate(request("queued"))
    llm.iterate()
    assert llm.waiting == [llm.results[1]]  # no slot for it yet
    consumer = asyncio.create_task(_collect(queued))
    await settle()
    await queued.aclose()  # another task closes it (barge-in)
    llm.iterate()  # the executor drops it from its queue without a response
    await settle()
    assert consumer.done() and consumer.result() == []
    assert llm.waiting == [] and queued.finish_reason == FinishReason.ABORTED
    await first.aclose()


async def test_a_cancelled_consumer_then_close_aborts(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    task = asyncio.create_task(_collect(stream))
    await settle()  # the consumer waits for the next ids
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert llm.results[0].aborts == 1


async def test_an_engine_error_becomes_a_backend_error(trt, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    llm.results[0].fail(RuntimeError("executor died"))
    with pytest.raises(BackendError, match="executor died"):
        await asyncio.wait_for(stream.__anext__(), 2.0)
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_generate_needs_a_started_backend_and_its_loop(trt12, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    backend = TrtllmBackend(model)
    with pytest.raises(BackendError, match="not started"):
        backend.generate(request())
    await backend.start()

    def other_loop() -> None:
        async def go() -> None:
            backend.generate(request())

        asyncio.run(go())

    with pytest.raises(BackendError, match="loop"):
        await asyncio.to_thread(other_loop)


# ---- pause and resume (a reader that stopped reading) ----


async def test_a_paused_stream_gives_its_slot_back_then_resumes_as_a_continuation_to_end_of_speech(trt, model) -> None:
    backend, llm = await started(model, max_batch_size=8)
    assert backend.audio_constraint == "position"
    stream = backend.generate(request(temperature=0.0))
    ids = await take(stream, 10, llm)
    stream.pause(True)
    await settle()
    llm.iterate()  # the executor ends the aborted request ("cancelled", read by nobody): its slot is free
    assert llm.results[0].aborts == 1 and llm.active == [] and llm.waiting == []
    stats = backend.stats()
    assert (stats["live_requests"], stats["paused_requests"], stats["pauses"]) == (1, 1, 1)
    stream.pause(False)
    await settle()
    assert llm.calls[-1] == {"inputs": [*request().prompt_ids, *ids], "streaming": True}
    p = llm.results[-1].sampling_params
    assert (p.max_tokens, p.seed, p.end_id, p.temperature) == (690, continuation_seed(7, 1), SPEC.end_of_speech, 0.0)
    assert p.logits_processor.offset == 10
    ids += await to_the_end(stream, llm)
    assert stream.finish_reason == FinishReason.STOP and SPEC.end_of_speech not in ids
    assert positions(ids) == [k % TOKENS_PER_FRAME for k in range(len(ids))]  # resumed mid-frame (10 % 7 == 3)
    stats = backend.stats()
    assert (stats["requests"], stats["live_requests"], stats["paused_requests"], stats["resumes"]) == (1, 0, 0, 1)
    assert stats["tokens"] == len(ids) and stats["aborted"] == 0


@pytest.mark.parametrize("overlap", [True, False])
async def test_a_greedy_stream_paused_and_resumed_mid_frame_gives_the_ids_of_one_never_paused(
    trt, model, overlap
) -> None:
    llm_kwargs = {} if overlap else {"disable_overlap_scheduler": True}
    backend, llm = await started(model, max_batch_size=8, llm_kwargs=llm_kwargs)
    whole = await to_the_end(backend.generate(request("whole", temperature=0.0)), llm)
    stream = backend.generate(request("paused", temperature=0.0))
    ids = await take(stream, 10, llm)
    for _ in range(2):  # paused at 10, then at 17: both mid-frame
        stream.pause(True)
        await settle()
        llm.iterate()
        stream.pause(False)
        await settle()
        ids += await take(stream, 7, llm)
    assert stream.attempt.request_id == "paused~2"
    ids += await to_the_end(stream, llm)
    assert ids == whole and len(whole) > 3 * TOKENS_PER_FRAME  # the penalty and the processor saw the same history
    assert stream.finish_reason == FinishReason.STOP


async def test_a_stream_paused_while_queued_is_dropped_without_an_answer_and_resumes_later(trt, model) -> None:
    backend, llm = await started(model, max_batch_size=1)
    first = backend.generate(request("first"))
    queued = backend.generate(request("queued"))
    llm.iterate()
    assert llm.waiting == [llm.results[1]]  # no slot for it yet
    queued.pause(True)
    await settle()
    llm.iterate()  # dropped from the queue without a response: nobody waits for one
    assert llm.waiting == [] and llm.results[1].cancelled
    queued.pause(False)
    await settle()
    assert llm.waiting == [llm.results[2]] and llm.calls[2]["inputs"] == list(request().prompt_ids)  # nothing yet
    await first.aclose()
    assert len(await take(queued, 3, llm)) == 3 and queued.attempt.request_id == "queued~1"
    await queued.aclose()
    assert llm.results[2].aborts == 1 and backend.stats()["live_requests"] == 0


# ---- quantize --format trtllm ----


def test_quantize_to_the_trtllm_format_refuses_on_1_3_in_one_line(trt13, tmp_path) -> None:
    from orpheus_tts_plugin.tools.quantize import quantize

    with pytest.raises(ValueError) as info:
        quantize("unused", tmp_path, fmt="trtllm")
    message = str(info.value)
    assert "\n" not in message and "1.3.0rc26" in message and "--format hf" in message


@pytest.mark.parametrize("installed", ["1.2", None])
def test_quantize_to_the_trtllm_format_goes_on_with_1_2_or_no_tensorrt_llm(installed, monkeypatch, tmp_path) -> None:
    from orpheus_tts_plugin.tools import quantize as q

    if installed:
        install(monkeypatch, installed)
    else:
        monkeypatch.setitem(sys.modules, "tensorrt_llm", None)

    def stop() -> None:
        raise ImportError("past the format check")

    monkeypatch.setattr(q, "import_modelopt", stop)
    with pytest.raises(ImportError, match="past the format check"):
        q.quantize("unused", tmp_path, fmt="trtllm")


# ---- LoRA adapters (the PyTorch backend's multi-LoRA path) ----


def peft_folder(path: Path, r: int) -> str:
    """A PEFT LoRA folder as the backend reads it at start (the stand-in's toy LoRA needs no weights)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 16}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


@pytest.fixture
def adapters(tmp_path: Path) -> list[tuple[str, str]]:
    return [("calm", peft_folder(tmp_path / "calm", 8)), ("bright", peft_folder(tmp_path / "bright", 24))]


def with_adapter(req: GenerationRequest, adapter: str | None) -> GenerationRequest:
    from dataclasses import replace

    return replace(req, adapter=adapter)


async def run_together(llm: LLM, streams: list) -> list[list[int]]:
    """All ids of `streams`, run in the same executor iterations until every one has ended."""
    tasks = [asyncio.create_task(_collect(s)) for s in streams]
    for _ in range(2000):
        if all(t.done() for t in tasks):
            break
        llm.iterate()
        await settle()
    return [[i for ids in t.result() for i in ids] for t in tasks]


async def test_adapters_build_the_llm_with_a_lora_config_holding_all_of_them(trt, model, adapters) -> None:
    from tests.trtllm_standin import LoraConfig

    backend, llm = await started(model, adapters=adapters)
    folders = {name: str(Path(path).resolve()) for name, path in adapters}
    # lora_dir in name order (ids 1, 2); the largest rank; every adapter on the GPU and in host memory at once.
    assert llm.kwargs["lora_config"] == LoraConfig(
        lora_dir=[folders["bright"], folders["calm"]], max_lora_rank=24, max_loras=2, max_cpu_loras=2
    )
    assert {n: (a.int_id, a.rank) for n, a in backend.loras.items()} == {"bright": (1, 24), "calm": (2, 8)}


async def test_without_adapters_no_lora_config_is_sent(trt, model) -> None:
    backend, llm = await started(model)
    assert "lora_config" not in llm.kwargs and backend.loras == {}


async def test_each_request_carries_its_adapters_lora_request_in_one_batch_with_base_rows(trt, model, adapters):
    from tests.trtllm_standin import LoRARequest

    backend, llm = await started(model, adapters=adapters, max_batch_size=8)
    rows = [None, "calm", "bright", "calm"]
    streams = [backend.generate(with_adapter(request(f"r{i}", temperature=0.0), a)) for i, a in enumerate(rows)]
    together = await run_together(llm, streams)
    assert "lora_request" not in llm.calls[0]
    folders = dict(adapters)
    assert llm.calls[1]["lora_request"] == LoRARequest("calm", 2, str(Path(folders["calm"]).resolve()))
    assert llm.calls[2]["lora_request"] == LoRARequest("bright", 1, str(Path(folders["bright"]).resolve()))
    assert llm.calls[1]["lora_request"] is llm.calls[3]["lora_request"]  # one object per adapter
    assert sorted(llm.loaded_loras) == ["1", "2"]
    # Each row of the mixed batch makes the ids it makes alone (the stand-in's toy LoRA moves the logits' peak).
    for adapter, ids in zip(rows, together, strict=True):
        alone = await run_together(llm, [backend.generate(with_adapter(request("alone", temperature=0.0), adapter))])
        assert ids == alone[0] and len(ids) > TOKENS_PER_FRAME
    assert together[0] != together[1] and together[0] != together[2] and together[1] != together[2]
    assert together[1] == together[3]


async def test_a_resumed_adapter_stream_keeps_its_adapter_and_gives_the_ids_of_one_never_paused(
    trt, model, adapters
) -> None:
    backend, llm = await started(model, adapters=adapters, max_batch_size=8)
    whole = await to_the_end(backend.generate(with_adapter(request("whole", temperature=0.0), "bright")), llm)
    stream = backend.generate(with_adapter(request("paused", temperature=0.0), "bright"))
    ids = await take(stream, 10, llm)
    stream.pause(True)
    await settle()
    llm.iterate()
    stream.pause(False)
    await settle()
    assert llm.calls[-1]["lora_request"] is llm.calls[0]["lora_request"]
    ids += await to_the_end(stream, llm)
    assert ids == whole and stream.attempt.adapter == "bright"


async def test_a_request_for_an_adapter_the_backend_was_not_started_with_is_refused(trt, model, adapters) -> None:
    backend, llm = await started(model, adapters=adapters[:1])
    with pytest.raises(BackendError, match="unknown LoRA adapter 'bright'.*serves: calm"):
        backend.generate(with_adapter(request(), "bright"))
    assert llm.calls == [] and backend.stats()["requests"] == 0


async def test_a_folder_that_is_not_a_peft_lora_is_refused_before_the_llm_is_built(trt, model, tmp_path) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    for folder, message in [("missing", "is not a folder"), ("ia3", "is not a LoRA \\(peft_type 'IA3'")]:
        backend = TrtllmBackend(model, adapters=[("x", str(tmp_path / folder))])
        with pytest.raises(ValueError, match=message):
            await backend.start()
    assert LLM.instances == []


def test_upstream_drops_a_lora_request_silently_without_a_lora_config(trt, model, adapters) -> None:
    """Why the backend always builds the LLM with lora_config: without one, base_worker._enqueue_request ignores
    lora_request and the base model answers; and LoRARequest checks its path exists at construction, any id goes."""
    from tests.trtllm_standin import LoRARequest

    llm = trt.LLM(model)
    result = llm.generate_async([1, 2, 3], trt.SamplingParams(), lora_request=LoRARequest("calm", 0, adapters[0][1]))
    assert result.request.lora_task is None and llm.loaded_loras == {}
    with pytest.raises(ValueError, match="does not exist"):
        LoRARequest("x", 1, str(Path(adapters[0][1]) / "nowhere"))


def test_make_backend_hands_the_configs_adapters_to_the_trtllm_backend(trt, model, adapters) -> None:
    from orpheus_tts_plugin.backends import make_backend
    from orpheus_tts_plugin.config import EngineConfig

    config = EngineConfig(model=model, backend="trtllm", adapters=dict(adapters))
    assert make_backend(config, SPEC, "cuda").adapters == tuple(sorted(adapters))
