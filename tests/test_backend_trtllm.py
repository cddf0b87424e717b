"""TensorRT-LLM backend against a stand-in `tensorrt_llm` that imitates the 1.2 LLM API and PyTorch executor.

TensorRT-LLM never ran in this project (no CUDA, wheel only on NVIDIA's index). The stand-in follows the upstream
1.2 code on the points this backend depends on, each named where it is imitated: the sampler `sampler_type`
selects (TorchSampler: one shared generator, no repetition penalty, embedding-bias rows stacked on the host every
step; TRTLLMSampler: per-request seeds and penalties, the bias copied once into the decoder's slot), the request
queue (an abort of a waiting request is dropped silently; an active one ends "cancelled" at the next iteration),
and `KvCacheConfig` / `SamplingParams` fields.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from orpheus_tts_plugin.backends.base import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
AUDIO = [SPEC.audio_token(0, 5), SPEC.audio_token(1, 6), SPEC.audio_token(2, 7), SPEC.audio_token(3, 8)]


# ---- stand-in for tensorrt_llm 1.2 (field names and defaults as upstream; unknown keywords raise) ----


@dataclass(kw_only=True)
class FakeSamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: torch.Tensor | None = None
    n: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True


@dataclass(kw_only=True)
class FakeKvCacheConfig:
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    dtype: str = "auto"


@dataclass(kw_only=True)
class FakeCudaGraphConfig:
    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    enable_padding: bool = False


class SamplerType12(str, enum.Enum):
    """tensorrt_llm/llmapi/llm_args.py SamplerType in 1.2."""

    TRTLLMSampler = "TRTLLMSampler"
    TorchSampler = "TorchSampler"
    auto = "auto"


class SamplerType14(str, enum.Enum):
    """After 1.3.0rc24 (docs of 1.3.0rc26, 1.4.0rc4): TRTLLMSampler removed, "TRTLLMSampler" rejected."""

    TorchSampler = "TorchSampler"
    auto = "auto"


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class FakeResult:
    """Like executor/result.py GenerationResult: async-iterates itself once per executor response."""

    def __init__(self, llm: FakeLLM, prompt: list[int], params: FakeSamplingParams):
        self.llm = llm
        self.prompt_token_ids = prompt
        self.sampling_params = params
        # llm_request.py LlmRequest.__init__ keeps its own bias tensor (from the C++ request): one per request.
        self.bias = None if params.embedding_bias is None else params.embedding_bias.clone()
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        self.aborts = 0
        self.cancelled = False
        self._done = False
        self._queue: asyncio.Queue[tuple[list[int], str | None] | BaseException] = asyncio.Queue()
        self._outputs = [FakeCompletionOutput(0)]

    @property
    def outputs(self) -> list[FakeCompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def step(self, ids: list[int], finish: str | None = None) -> None:
        """One response of the executor (tests that drive outputs by hand)."""
        self._queue.put_nowait((ids, finish))

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def abort(self) -> None:
        """Like GenerationResult.abort → executor.abort_request: only marks the id; nothing is sent back now."""
        self.aborts += 1
        self.cancelled = True

    def __aiter__(self) -> FakeResult:
        return self

    async def __anext__(self) -> FakeResult:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        ids, finish = item
        out = self._outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(ids)
        if finish is not None:
            self._done = True
            out.finish_reason = finish
        return self


_LLM_ARGS = {
    "model",
    "tokenizer",
    "skip_tokenizer_init",
    "kv_cache_config",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "cuda_graph_config",
    "enable_chunked_prefill",
    "disable_overlap_scheduler",
    "backend",
    "dtype",
    "trust_remote_code",
    "tensor_parallel_size",
    "sampler_type",
}


class FakeLLM:
    """Like llmapi/llm.py LLM with the PyTorch executor (_torch/pyexecutor/py_executor.py PyExecutor)."""

    instances: list[FakeLLM] = []
    sampler_types: type[enum.Enum] = SamplerType12

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - _LLM_ARGS
        if unknown:
            raise TypeError(f"unexpected LLM arguments {unknown}")
        self.model = model
        self.kwargs = kwargs
        # llm_args.py TorchLlmArgs.sampler_type: "auto" → TorchSampler unless beam search; an unknown name raises.
        requested = kwargs.get("sampler_type", "auto")
        self.sampler = self.sampler_types(requested).value
        self.sampler = "TorchSampler" if self.sampler == "auto" else self.sampler
        self.results: list[FakeResult] = []
        self.calls: list[dict[str, Any]] = []
        self.active: list[FakeResult] = []
        self.waiting: list[FakeResult] = []
        self.host_bias_bytes_per_step: list[int] = []
        self.bias_uploads = 0
        self.shared_generator = torch.Generator().manual_seed(0)
        self.shut = False
        FakeLLM.instances.append(self)

    def generate_async(
        self,
        inputs: Any,
        sampling_params: FakeSamplingParams | None = None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming: bool = False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        scheduling_params=None,
    ) -> FakeResult:
        assert isinstance(sampling_params, FakeSamplingParams)
        self.calls.append({"inputs": inputs, "streaming": streaming})
        result = FakeResult(self, list(inputs), sampling_params)
        self.results.append(result)
        self.waiting.append(result)
        return result

    def iterate(self) -> None:
        """One executor iteration: cancellations, admission into free slots, one sampled token per active request."""
        # py_executor.py PyExecutor._handle_canceled_requests: executor_request_queue.update_waiting_queue() drops
        # cancelled waiting requests without a response; active ones finish with FinishReason.CANCELLED.
        self.waiting = [r for r in self.waiting if not r.cancelled]
        for r in [r for r in self.active if r.cancelled]:
            self.active.remove(r)
            r.step([], "cancelled")
        while self.waiting and len(self.active) < self.kwargs.get("max_batch_size", 2048):
            r = self.waiting.pop(0)
            self.active.append(r)
            if self.sampler == "TRTLLMSampler" and r.bias is not None:
                self.bias_uploads += 1  # CreateNewDecoderRequests::newRequest copies it into the slot, once
        if self.sampler == "TorchSampler":
            # sampler.py TorchSampler._apply_embedding_bias: unique bias tensors (by identity) stacked into a
            # pinned host tensor and copied to the GPU every step.
            unique = {id(r.bias): r.bias for r in self.active if r.bias is not None}
            self.host_bias_bytes_per_step.append(sum(b.numel() * b.element_size() for b in unique.values()))
        else:
            self.host_bias_bytes_per_step.append(0)
        for r in self.active:
            r.step([self._sample(r)])

    def _sample(self, r: FakeResult) -> int:
        """A toy model whose logits fall slowly away from one id; the sampler decides penalty and randomness."""
        distance = (torch.arange(SPEC.vocab_size) - SPEC.first_audio_token).abs().to(torch.float32)
        logits = 1.0 - 1e-4 * distance  # the first audio id on top, its neighbours just below
        if r.bias is not None:
            logits = logits + r.bias
        p = r.sampling_params
        seen = r.prompt_token_ids + r.outputs[0].token_ids
        if self.sampler == "TRTLLMSampler" and p.repetition_penalty not in (None, 1.0) and seen:
            # The C++ decoder's penalty kernel: seen ids' positive logits divided, negative ones multiplied.
            idx = torch.tensor(sorted(set(seen)))
            vals = logits[idx]
            logits[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # TorchSampler in 1.2 applies no repetition penalty and draws from one generator for every request
        # (sampler.py TorchSampler.get_generator); TRTLLMSampler seeds each request's curand state.
        if not p.temperature:
            return int(torch.argmax(logits))
        gen = r.generator if self.sampler == "TRTLLMSampler" else self.shared_generator
        probs = torch.softmax(logits / p.temperature, dim=0)
        return int(torch.multinomial(probs, 1, generator=gen))

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    root = types.ModuleType("tensorrt_llm")
    root.__version__ = "1.2.1"
    root.LLM = FakeLLM
    root.SamplingParams = FakeSamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = FakeKvCacheConfig
    llmapi.CudaGraphConfig = FakeCudaGraphConfig
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.SamplerType = SamplerType12
    root.llmapi = llmapi
    llmapi.llm_args = llm_args
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi.llm_args", llm_args)
    monkeypatch.setattr(FakeLLM, "sampler_types", SamplerType12)
    FakeLLM.instances = []
    return root


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
    return backend, FakeLLM.instances[-1]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _collect(stream) -> list[list[int]]:
    return [ids async for ids in stream]


async def take(stream, n: int, llm: FakeLLM) -> list[int]:
    """The next `n` ids of `stream`, running one executor iteration per id."""
    out: list[int] = []
    while len(out) < n:
        llm.iterate()
        out += await asyncio.wait_for(stream.__anext__(), 2.0)
    return out


# ---- import, version, sampler ----


def test_import_guard_says_how_to_get_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    import orpheus_tts_plugin.backends.trtllm as mod  # the module itself imports without TensorRT-LLM

    with pytest.raises(ImportError) as info:
        mod.TrtllmBackend("/models/x")
    message = str(info.value)
    assert "pypi.nvidia.com" in message and "nvcr.io/nvidia/tensorrt-llm/release:1.2" in message


def test_a_tensorrt_llm_older_than_1_2_is_refused(fake_trtllm) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    fake_trtllm.__version__ = "1.1.0"
    with pytest.raises(ImportError, match="found TensorRT-LLM 1.1.0"):
        TrtllmBackend("/models/x")


def test_a_tensorrt_llm_without_trtllm_sampler_is_refused_unless_a_sampler_is_chosen(fake_trtllm, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    fake_trtllm.__version__ = "1.4.0"
    fake_trtllm.llmapi.llm_args.SamplerType = SamplerType14
    with pytest.raises(ImportError, match="no TRTLLMSampler.*per-request seeds"):
        TrtllmBackend(model)
    backend = TrtllmBackend(model, llm_kwargs={"sampler_type": "TorchSampler"})  # the caller's own choice
    assert backend.llm_args()["sampler_type"] == "TorchSampler"


async def test_the_llm_uses_trtllm_sampler(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    assert llm.kwargs["sampler_type"] == "TRTLLMSampler" and llm.sampler == "TRTLLMSampler"
    await backend.close()


async def test_seeded_requests_repeat_even_when_batched_together(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    a, b, c = (backend.generate(request(rid, seed=s, temperature=1.0)) for rid, s in (("a", 7), ("b", 7), ("c", 8)))
    ids = [await take(s, 12, llm) for s in (a, b, c)]
    assert ids[0] == ids[1] != ids[2]  # TorchSampler's one shared generator would give a != b
    for s in (a, b, c):
        await s.aclose()


async def test_the_repetition_penalty_takes_effect(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request(temperature=0.0))  # greedy, repetition_penalty 1.1
    ids = await take(stream, 6, llm)
    assert len(set(ids)) == 6  # unpenalised greedy would repeat the top id six times
    await stream.aclose()


async def test_no_embedding_bias_row_is_copied_from_the_host_per_step(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    streams = [backend.generate(request(f"r{i}")) for i in range(8)]
    for _ in range(3):
        llm.iterate()
    assert llm.host_bias_bytes_per_step == [0, 0, 0]  # TorchSampler: 8 rows of 628 kB every step
    assert llm.bias_uploads == 8  # once per request, into its decoder slot
    for s in streams:
        await s.aclose()


# ---- LLM arguments ----


async def test_llm_is_built_with_the_kv_cache_cuda_graphs_and_limits(fake_trtllm, model) -> None:
    backend, llm = await started(
        model, max_batch_size=128, max_num_tokens=8192, max_seq_len=4096, kv_cache_fraction=0.85
    )
    assert llm.model == model
    kv = llm.kwargs["kv_cache_config"]
    assert isinstance(kv, FakeKvCacheConfig) and kv.free_gpu_memory_fraction == 0.85
    graphs = llm.kwargs["cuda_graph_config"]
    assert isinstance(graphs, FakeCudaGraphConfig) and graphs.enable_padding and graphs.max_batch_size == 128
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
async def test_the_kv_cache_dtype_follows_the_checkpoint(fake_trtllm, tmp_path, kv, given, expected) -> None:
    _, llm = await started(checkpoint(tmp_path / "m", kv=kv), kv_cache_dtype=given)
    assert llm.kwargs["kv_cache_config"].dtype == expected


async def test_an_unreadable_checkpoint_gets_the_kv_cache_dtype_auto(fake_trtllm, monkeypatch, tmp_path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _, llm = await started("org/not-cached")
    assert llm.kwargs["kv_cache_config"].dtype == "auto"


async def test_explicit_cuda_graph_batch_sizes_and_extra_llm_kwargs_are_passed(fake_trtllm, model) -> None:
    backend, llm = await started(
        model, cuda_graph_batch_sizes=[1, 8, 64], llm_kwargs={"disable_overlap_scheduler": True}
    )
    assert llm.kwargs["cuda_graph_config"].batch_sizes == [1, 8, 64]
    assert llm.kwargs["disable_overlap_scheduler"] is True
    await backend.close()


# ---- requests ----


async def test_a_request_is_token_ids_with_end_id_and_sampling_but_no_redundant_stop_id(fake_trtllm, model) -> None:
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


async def test_extra_stop_ids_are_sent_without_the_end_id(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request(stop=(SPEC.end_of_speech, 4242)))
    assert llm.results[0].sampling_params.stop_token_ids == [4242]
    await stream.aclose()


async def test_the_embedding_bias_allows_exactly_audio_ids_and_end(fake_trtllm, model) -> None:
    from orpheus_tts_plugin.backends.trtllm import FORBIDDEN_BIAS

    backend, llm = await started(model)
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


async def test_with_the_constraint_off_no_bias_is_sent(fake_trtllm, model) -> None:
    backend, llm = await started(model, constrain_audio=False)
    stream = backend.generate(request())
    assert llm.results[0].sampling_params.embedding_bias is None
    await stream.aclose()


async def test_the_bias_length_follows_the_checkpoint_vocab(fake_trtllm, tmp_path) -> None:
    backend, llm = await started(checkpoint(tmp_path / "padded", vocab=157_056))  # a padded vocabulary
    stream = backend.generate(request())
    bias = llm.results[0].sampling_params.embedding_bias
    assert tuple(bias.shape) == (157_056,) and bias[156_999] < 0 and bias[SPEC.first_audio_token] == 0
    await stream.aclose()


async def test_token_ids_diff_streams_and_the_end_id_is_dropped(fake_trtllm, model) -> None:
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


async def test_a_length_finish_is_reported_as_length(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request(max_new=3))
    llm.results[0].step(AUDIO[:3], "length")
    assert await asyncio.wait_for(_collect(stream), 2.0) == [AUDIO[:3]]
    assert stream.finish_reason == FinishReason.LENGTH


# ---- aborts ----


async def test_closing_an_active_stream_aborts_the_request(fake_trtllm, model) -> None:
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


async def test_closing_a_queued_stream_ends_its_waiting_consumer(fake_trtllm, model) -> None:
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


async def test_a_cancelled_consumer_then_close_aborts(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    task = asyncio.create_task(_collect(stream))
    await settle()  # the consumer waits for the next ids
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert llm.results[0].aborts == 1


async def test_an_engine_error_becomes_a_backend_error(fake_trtllm, model) -> None:
    backend, llm = await started(model)
    stream = backend.generate(request())
    llm.results[0].fail(RuntimeError("executor died"))
    with pytest.raises(BackendError, match="executor died"):
        await asyncio.wait_for(stream.__anext__(), 2.0)
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_generate_needs_a_started_backend_and_its_loop(fake_trtllm, model) -> None:
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
