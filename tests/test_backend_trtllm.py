"""TensorRT-LLM backend against a stand-in `tensorrt_llm` that follows the 1.2 LLM API signatures.

TensorRT-LLM itself cannot run here (no CUDA, wheel only on NVIDIA's index): these tests check the requests we
build (LLM args, SamplingParams fields, end/stop ids, embedding bias, token-id prompts), the streaming of
`token_ids_diff`, finish reasons, and that closing a stream calls `result.abort()`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from orpheus_tts_plugin.backends.base import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
AUDIO = [SPEC.audio_token(0, 5), SPEC.audio_token(1, 6), SPEC.audio_token(2, 7), SPEC.audio_token(3, 8)]


# ---- stand-in for tensorrt_llm 1.2 (field names and defaults as documented; unknown keywords raise) ----


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
    """Like GenerationResult: async-iterates itself once per executor response; abort() cancels."""

    def __init__(self, prompt: list[int], params: FakeSamplingParams):
        self.prompt_token_ids = prompt
        self.sampling_params = params
        self.aborts = 0
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
        self._queue.put_nowait((ids, finish))

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def abort(self) -> None:
        self.aborts += 1
        self.step([], "cancelled")

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
}


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - _LLM_ARGS
        if unknown:
            raise TypeError(f"unexpected LLM arguments {unknown}")
        self.model = model
        self.kwargs = kwargs
        self.results: list[FakeResult] = []
        self.calls: list[dict[str, Any]] = []
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
        result = FakeResult(list(inputs), sampling_params)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    root = types.ModuleType("tensorrt_llm")
    root.LLM = FakeLLM
    root.SamplingParams = FakeSamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = FakeKvCacheConfig
    llmapi.CudaGraphConfig = FakeCudaGraphConfig
    root.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    FakeLLM.instances = []
    return root


def request(rid: str = "r1", *, constrain: bool = True, max_new: int = 700, seed: int | None = 7) -> GenerationRequest:
    prompt = (SPEC.start_of_human, SPEC.bos, 1234, 56, 789, *SPEC.prompt_suffix())
    sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=6144, seed=seed)
    return GenerationRequest(rid, prompt, sampling, max_new, (SPEC.end_of_speech,), constrain)


async def started(**kwargs: Any):
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    backend = TrtllmBackend("/models/orpheus-fp8", **kwargs)
    await backend.start()
    return backend, FakeLLM.instances[-1]


# ---- tests ----


def test_import_guard_says_how_to_get_tensorrt_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import raises ImportError
    import orpheus_tts_plugin.backends.trtllm as mod  # the module itself imports without TensorRT-LLM

    with pytest.raises(ImportError) as info:
        mod.TrtllmBackend("/models/x")
    message = str(info.value)
    assert "pypi.nvidia.com" in message and "nvcr.io/nvidia/tensorrt-llm/release:1.2" in message


async def test_llm_is_built_with_fp8_kv_cache_cuda_graphs_and_limits(fake_trtllm) -> None:
    backend, llm = await started(max_batch_size=128, max_num_tokens=8192, max_seq_len=4096, kv_cache_fraction=0.85)
    assert llm.model == "/models/orpheus-fp8"
    kv = llm.kwargs["kv_cache_config"]
    assert isinstance(kv, FakeKvCacheConfig) and kv.dtype == "fp8" and kv.free_gpu_memory_fraction == 0.85
    graphs = llm.kwargs["cuda_graph_config"]
    assert isinstance(graphs, FakeCudaGraphConfig) and graphs.enable_padding and graphs.max_batch_size == 128
    assert (llm.kwargs["max_batch_size"], llm.kwargs["max_num_tokens"], llm.kwargs["max_seq_len"]) == (128, 8192, 4096)
    assert llm.kwargs["enable_chunked_prefill"] is True
    await backend.close()
    assert llm.shut


async def test_explicit_cuda_graph_batch_sizes_and_extra_llm_kwargs(fake_trtllm) -> None:
    backend, llm = await started(cuda_graph_batch_sizes=[1, 8, 64], llm_kwargs={"disable_overlap_scheduler": True})
    assert llm.kwargs["cuda_graph_config"].batch_sizes == [1, 8, 64]
    assert llm.kwargs["disable_overlap_scheduler"] is True
    await backend.close()


async def test_request_uses_token_ids_end_id_stop_ids_and_sampling(fake_trtllm) -> None:
    backend, llm = await started()
    req = request(max_new=321)
    stream = backend.generate(req)
    assert llm.calls[0] == {"inputs": list(req.prompt_ids), "streaming": True}
    p = llm.results[0].sampling_params
    assert p.end_id == SPEC.end_of_speech == 128258 and p.stop_token_ids == [128258]
    assert p.detokenize is False and p.max_tokens == 321 and p.pad_id == SPEC.pad
    assert (p.temperature, p.top_p, p.repetition_penalty, p.seed) == (0.6, 0.8, 1.1, 7)
    await stream.aclose()
    await backend.close()


async def test_embedding_bias_allows_exactly_audio_ids_and_end(fake_trtllm) -> None:
    from orpheus_tts_plugin.backends.trtllm import FORBIDDEN_BIAS

    backend, llm = await started()
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


async def test_backend_level_constrain_off_sends_no_bias(fake_trtllm) -> None:
    backend, llm = await started(constrain_audio=False)
    stream = backend.generate(request())
    assert llm.results[0].sampling_params.embedding_bias is None
    await stream.aclose()


async def test_bias_length_follows_local_checkpoint_vocab(fake_trtllm, tmp_path) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 157_056}))  # padded vocab
    backend = TrtllmBackend(str(tmp_path))
    await backend.start()
    backend.generate(request())
    bias = FakeLLM.instances[-1].results[0].sampling_params.embedding_bias
    assert tuple(bias.shape) == (157_056,) and bias[156_999] < 0 and bias[SPEC.first_audio_token] == 0


async def test_streams_token_ids_diff_and_strips_end_id(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request())
    result = llm.results[0]
    result.step(AUDIO[:2])
    result.step([])
    result.step(AUDIO[2:3])
    result.step([AUDIO[3], SPEC.end_of_speech], "stop")
    got = [ids async for ids in stream]
    assert got == [AUDIO[:2], AUDIO[2:3], AUDIO[3:4]]
    assert stream.finish_reason == FinishReason.STOP
    await stream.aclose()
    assert result.aborts == 0  # a finished request is not aborted
    stats = backend.stats()
    assert stats["live_requests"] == 0 and stats["tokens"] == 4 and stats["requests"] == 1


async def test_length_finish_reason(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request(max_new=3))
    llm.results[0].step(AUDIO[:3], "length")
    assert [ids async for ids in stream] == [AUDIO[:3]]
    assert stream.finish_reason == FinishReason.LENGTH


async def test_closing_the_stream_aborts_the_request(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request())
    result = llm.results[0]
    result.step(AUDIO[:2])
    assert await stream.__anext__() == AUDIO[:2]
    await stream.aclose()
    assert result.aborts == 1 and stream.finish_reason == FinishReason.ABORTED
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    await stream.aclose()
    assert result.aborts == 1
    assert backend.stats()["aborted"] == 1 and backend.stats()["live_requests"] == 0


async def test_cancelled_consumer_then_close_aborts(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request())

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)  # the consumer waits inside __anext__
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    assert llm.results[0].aborts == 1


async def test_close_from_another_task_ends_a_waiting_consumer(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request())
    consumer = asyncio.create_task(asyncio.wait_for(_collect(stream), 2.0))
    await asyncio.sleep(0.01)
    await stream.aclose()
    assert await consumer == []  # woken by the cancellation response, nothing delivered after close
    assert llm.results[0].aborts == 1


async def _collect(stream) -> list[list[int]]:
    return [ids async for ids in stream]


async def test_engine_error_becomes_backend_error(fake_trtllm) -> None:
    backend, llm = await started()
    stream = backend.generate(request())
    llm.results[0].fail(RuntimeError("executor died"))
    with pytest.raises(BackendError, match="executor died"):
        await stream.__anext__()
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_generate_requires_start_and_the_starting_loop(fake_trtllm) -> None:
    from orpheus_tts_plugin.backends.trtllm import TrtllmBackend

    backend = TrtllmBackend("/models/x")
    with pytest.raises(BackendError, match="not started"):
        backend.generate(request())
    await backend.start()

    def other_loop() -> None:
        async def go() -> None:
            backend.generate(request())

        asyncio.run(go())

    with pytest.raises(BackendError, match="loop"):
        await asyncio.to_thread(other_loop)
