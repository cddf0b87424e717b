"""vLLM backend against a stand-in `vllm` that follows AsyncLLM / SamplingParams / TokensPrompt signatures.

vLLM cannot run here (no GPU): these tests check the engine args and per-request SamplingParams we build (FP8,
delta outputs, ids only, stop ids, allowed ids), token-id prompts, streaming of deltas and that closing a stream
aborts the request (`await engine.abort(request_id)` and cancellation of vLLM's generator).
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
import types
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pytest

from orpheus_tts_plugin.backends.base import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
AUDIO = [SPEC.audio_token(0, 1), SPEC.audio_token(1, 2), SPEC.audio_token(2, 3), SPEC.audio_token(3, 4)]


# ---- stand-in for vllm (v1 engine); field names as documented, unknown keywords raise ----


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class FakeSamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    detokenize: bool = True
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


@dataclass(kw_only=True)
class FakeEngineArgs:
    model: str = "facebook/opt-125m"
    tokenizer: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool = False
    enforce_eager: bool = False


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: list[FakeCompletionOutput]
    finished: bool


@dataclass
class FakeRequest:
    prompt: Any
    params: FakeSamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    internal_aborts: int = 0


class FakeAsyncLLM:
    instances: list[FakeAsyncLLM] = []

    def __init__(self, engine_args: FakeEngineArgs):
        self.engine_args = engine_args
        self.requests: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []
        self.shut = False
        FakeAsyncLLM.instances.append(self)

    @classmethod
    def from_engine_args(
        cls, engine_args: FakeEngineArgs, start_engine_loop: bool = True, usage_context=None, stat_loggers=None
    ) -> FakeAsyncLLM:
        assert isinstance(engine_args, FakeEngineArgs)
        return cls(engine_args)

    async def generate(
        self,
        prompt: Any,
        sampling_params: FakeSamplingParams,
        request_id: str,
        *,
        lora_request=None,
        trace_headers=None,
        priority: int = 0,
    ):
        """Like AsyncLLM.generate: yields RequestOutputs; cancellation or aclose aborts internally."""
        req = FakeRequest(prompt, sampling_params)
        self.requests[request_id] = req
        try:
            while True:
                ids, finish = await req.queue.get()
                out = FakeRequestOutput(request_id, [FakeCompletionOutput(0, "", ids, finish)], finish is not None)
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            req.internal_aborts += 1
            raise

    def step(self, request_id: str, ids: list[int], finish: str | None = None) -> None:
        self.requests[request_id].queue.put_nowait((ids, finish))

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    root = types.ModuleType("vllm")
    root.AsyncEngineArgs = FakeEngineArgs
    root.SamplingParams = FakeSamplingParams
    root.TokensPrompt = TokensPrompt
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = RequestOutputKind
    sp.SamplingParams = FakeSamplingParams
    v1 = types.ModuleType("vllm.v1")
    v1_engine = types.ModuleType("vllm.v1.engine")
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    async_llm.AsyncLLM = FakeAsyncLLM
    for name, mod in {
        "vllm": root,
        "vllm.sampling_params": sp,
        "vllm.v1": v1,
        "vllm.v1.engine": v1_engine,
        "vllm.v1.engine.async_llm": async_llm,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeAsyncLLM.instances = []
    return root


def request(rid: str = "r1", *, constrain: bool = True, max_new: int = 700) -> GenerationRequest:
    prompt = (SPEC.start_of_human, SPEC.bos, 11, 22, 33, *SPEC.prompt_suffix())
    sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=6144, seed=3)
    return GenerationRequest(rid, prompt, sampling, max_new, (SPEC.end_of_speech,), constrain)


async def started(model: str = "canopylabs/orpheus-3b-0.1-ft", **kwargs: Any):
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    backend = VllmBackend(model, **kwargs)
    await backend.start()
    return backend, FakeAsyncLLM.instances[-1]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---- tests ----


def test_import_guard_says_how_to_get_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    import orpheus_tts_plugin.backends.vllm as mod

    with pytest.raises(ImportError, match=r"pip install"):
        mod.VllmBackend("x")


async def test_engine_args_fp8_weights_and_kv_cache(fake_vllm) -> None:
    backend, engine = await started(
        max_batch_size=96, max_num_tokens=4096, max_seq_len=2048, engine_kwargs={"enforce_eager": True}
    )
    a = engine.engine_args
    assert (a.model, a.quantization, a.kv_cache_dtype) == ("canopylabs/orpheus-3b-0.1-ft", "fp8", "fp8")
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len) == (96, 4096, 2048)
    assert a.enforce_eager is True
    await backend.close()
    assert engine.shut


async def test_prequantized_checkpoint_is_not_quantized_again(fake_vllm, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt"}}))
    _, engine = await started(str(tmp_path))
    assert engine.engine_args.quantization is None and engine.engine_args.kv_cache_dtype == "fp8"


async def test_request_is_token_ids_with_delta_ids_only_sampling(fake_vllm) -> None:
    backend, engine = await started()
    req = request(max_new=250)
    stream = backend.generate(req)
    await settle()
    sent = engine.requests["r1"]
    assert sent.prompt == {"prompt_token_ids": list(req.prompt_ids)}
    p = sent.params
    assert p.output_kind is RequestOutputKind.DELTA and p.detokenize is False and p.n == 1
    assert p.stop_token_ids == [128258] and p.max_tokens == 250
    assert (p.temperature, p.top_p, p.repetition_penalty, p.seed) == (0.6, 0.8, 1.1, 3)
    assert p.allowed_token_ids == [*range(SPEC.first_audio_token, SPEC.audio_token_end), SPEC.end_of_speech]
    await stream.aclose()


async def test_unconstrained_request_has_no_allowed_ids(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request(constrain=False))
    await settle()
    assert engine.requests["r1"].params.allowed_token_ids is None
    await stream.aclose()


async def test_streams_deltas_and_strips_stop_id(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:2])
    engine.step("r1", AUDIO[2:3])
    engine.step("r1", [AUDIO[3], SPEC.end_of_speech], "stop")
    assert [ids async for ids in stream] == [AUDIO[:2], AUDIO[2:3], AUDIO[3:4]]
    assert stream.finish_reason == FinishReason.STOP
    await stream.aclose()
    assert engine.aborted == []
    assert backend.stats()["live_requests"] == 0 and backend.stats()["tokens"] == 4


async def test_length_finish(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request(max_new=2))
    await settle()
    engine.step("r1", AUDIO[:2], "length")
    assert [ids async for ids in stream] == [AUDIO[:2]]
    assert stream.finish_reason == FinishReason.LENGTH


async def test_close_aborts_in_vllm(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request())
    await settle()
    engine.step("r1", AUDIO[:1])
    assert await stream.__anext__() == AUDIO[:1]
    await stream.aclose()
    await settle()
    assert engine.aborted == ["r1"] and engine.requests["r1"].internal_aborts == 1
    assert stream.finish_reason == FinishReason.ABORTED
    engine.step("r1", AUDIO[1:2])
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert backend.stats()["aborted"] == 1 and backend.stats()["live_requests"] == 0


async def test_close_from_another_task_wakes_the_consumer(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request())
    consumer = asyncio.create_task(asyncio.wait_for(_collect(stream), 2.0))
    await settle()
    await stream.aclose()
    assert await consumer == []
    assert engine.aborted == ["r1"]


async def _collect(stream) -> list[list[int]]:
    return [ids async for ids in stream]


async def test_engine_failure_is_backend_error(fake_vllm) -> None:
    backend, engine = await started()
    stream = backend.generate(request())
    await settle()
    engine.requests["r1"].queue.put_nowait(None)  # unpacking None raises inside vLLM's generator
    with pytest.raises(BackendError):
        await stream.__anext__()
    assert stream.finish_reason == FinishReason.ERROR and backend.stats()["errors"] == 1


async def test_generate_requires_start(fake_vllm) -> None:
    from orpheus_tts_plugin.backends.vllm import VllmBackend

    with pytest.raises(BackendError, match="not started"):
        VllmBackend("m").generate(request())
