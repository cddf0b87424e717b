"""What both TensorRT-LLM lines share: the LLM API surface, the request path into the worker, the executor loop.

Imitated, not copied, from NVIDIA/TensorRT-LLM as the code index holds it (sampling_params.py at 000a01de,
executor/result.py, py_executor.py and the decoder runner of main, late 2026):
  * `tensorrt_llm/sampling_params.py` SamplingParams: field names and defaults (unknown keywords raise);
    `logits_processor` is a callable `(req_id, logits [beams, 1, vocab], token_ids, stream_ptr, client_id)`.
  * `executor/proxy.py` → `executor/base_worker.py`: a request's SamplingParams cross a process boundary pickled, so
    the worker holds its own copy of every tensor and processor (issue #17436: identical biases stop being shared).
  * `executor/result.py` GenerationResult: async-iterates itself once per response; `abort()` only marks the id;
    `finish_reason` 'stop' | 'length' | 'timeout' (tllm.FinishReason.TIMED_OUT) | 'cancelled'.
  * `_torch/pyexecutor/py_executor.py` `_handle_canceled_requests` → `executor_request_queue.update_waiting_queue()`:
    a cancelled request still waiting is dropped without any response; an active one finishes "cancelled".
  * the decoder runner's `_execute_logit_post_processors` / `_apply_logits_processors`: one Python call per scheduled
    row of a request with processors (every context chunk, then every generation step), after `inspect.signature(lp)`
    is checked again, with `[request.get_tokens(0)]` (a full copy of the history); with the overlap scheduler (on
    unless `disable_overlap_scheduler=True`) that history lacks the token sampled in the previous step (#16785).
  * LoRA, the PyTorch backend's multi-LoRA path (docs/source/features/lora.md): `lora_helper.py` LoraConfig (a
    dataclass: lora_dir, lora_ckpt_source, max_lora_rank, lora_target_modules, trtllm_modules_to_hf_modules,
    max_loras, max_cpu_loras, lora_weights_converters; `__post_init__` asserts the source is "hf" or "nemo"),
    re-exported by `lora_manager.py`; `executor/request.py` LoRARequest(lora_name, lora_int_id, lora_path,
    lora_ckpt_source) whose `__post_init__` raises ValueError for a path that does not exist (in the caller's
    process, at construction) and takes any int id, 0 included (upstream's own examples use 0); and
    `executor/base_worker.py` `_enqueue_request` / `_load_lora_adapter`: only when the LLM has a LoRA manager (a
    lora_config) is a request's lora_request used: without one it is dropped silently and the base model answers;
    the adapter is loaded once per `str(lora_int_id)` (LoraManager.load_from_ckpt returns only newly loaded uids), so
    a second path under a loaded id is never read.
The sampler (which one, penalties, seeds, embedding bias) is each line's own: line12.py, line13.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH


@dataclass(kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: torch.Tensor | None = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
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


@dataclass
class LoraConfig:
    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    lora_weights_converters: list[str] = field(default_factory=lambda: ["default"])

    def __post_init__(self) -> None:
        assert self.lora_ckpt_source in ["hf", "nemo"], "lora_ckpt_source must be one of 'hf' or 'nemo'"


@dataclass(slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self) -> None:
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")
        if self.lora_ckpt_source not in ["hf", "nemo"]:
            raise ValueError(f"lora_ckpt_source must be 'hf' or 'nemo', got '{self.lora_ckpt_source}'")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(kw_only=True)
class KvCacheConfig:
    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    dtype: str = "auto"


@dataclass(kw_only=True)
class CudaGraphConfig:
    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    enable_padding: bool = False


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class Request:
    """The worker's side of one request (py_executor LlmRequest): its own params, tokens, slot and host history."""

    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams, lora_task: int | None = None):
        self.request_id = request_id
        self.lora_task = lora_task  # the LoRA task id (lora_int_id) the worker runs it with; None: the base model
        self.prompt = prompt
        self.params = params
        self.generated: list[int] = []
        self.visible = 0  # generated tokens the host history shows (one behind under the overlap scheduler)
        self.context_left = 1  # context chunks still to run; the last one samples the first token
        self.slot: int | None = None
        lp = params.logits_processor
        self.processors: list[Any] = [] if lp is None else list(lp) if isinstance(lp, list) else [lp]
        self.bias = params.embedding_bias

    def get_tokens(self, beam: int = 0) -> list[int]:
        """LlmRequest.get_tokens: a copy of prompt + the host-visible generated tokens."""
        return [*self.prompt, *self.generated[: self.visible]]


class GenerationResult:
    """Like executor/result.py GenerationResult: async-iterates itself once per executor response."""

    def __init__(self, llm: LLM, prompt: list[int], params: SamplingParams, request: Request):
        self.llm = llm
        self.prompt_token_ids = prompt
        self.sampling_params = params  # the caller's object
        self.request = request  # the worker's copy
        self.aborts = 0
        self.cancelled = False
        self._done = False
        self._queue: asyncio.Queue[tuple[list[int], str | None] | BaseException] = asyncio.Queue()
        self._outputs = [CompletionOutput(0)]

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def bias(self) -> torch.Tensor | None:
        return self.request.bias

    def step(self, ids: list[int], finish: str | None = None) -> None:
        """One response of the executor (tests that drive outputs by hand)."""
        self._queue.put_nowait((ids, finish))

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def abort(self) -> None:
        """GenerationResult.abort → executor.abort_request: only marks the id; nothing is sent back now."""
        self.aborts += 1
        self.cancelled = True

    def __aiter__(self) -> GenerationResult:
        return self

    async def __anext__(self) -> GenerationResult:
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


LLM_ARGS = {
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
    "lora_config",
}

_BASE_LOGITS: dict[int, torch.Tensor] = {}


def lora_logits(logits: torch.Tensor, requests: list[Request], loaded: dict[str, str]) -> None:
    """The toy model's LoRA: an adapter (by its folder's name) moves a row's peak up by that many ids, per row."""
    for row, r in enumerate(requests):
        if r.lora_task is not None:
            shift = sum(map(ord, Path(loaded[str(r.lora_task)]).name)) % 97 + 1
            logits[row] = torch.roll(logits[row], shift)


def toy_logits(rows: int, vocab: int) -> torch.Tensor:
    """A toy model: logits fall slowly away from the first audio id (its neighbours just below), every row alike."""
    base = _BASE_LOGITS.get(vocab)
    if base is None:
        distance = (torch.arange(vocab) - SPEC.first_audio_token).abs().to(torch.float32)
        base = _BASE_LOGITS[vocab] = 1.0 - 1e-4 * distance
    return base.expand(rows, vocab).clone()


def run_logits_processors(requests: list[Request], logits: torch.Tensor) -> None:
    """_execute_logit_post_processors: per request with processors, a history copy, a signature check, one call."""
    for row, r in enumerate(requests):
        if not r.processors:
            continue
        token_ids = [r.get_tokens(0)]
        rows = logits[row : row + 1].view(1, 1, -1)
        for lp in r.processors:
            params = inspect.signature(lp).parameters
            assert 4 <= len(params) <= 5, "Logit post processor signature must match the LogitsProcessor interface"
            lp(r.request_id, rows, token_ids, None, None)


def repetition_penalty(logits: torch.Tensor, seen: list[int], penalty: float | None) -> None:
    """The occurrence penalty of both lines: seen ids' positive logits divided by it, negative ones multiplied."""
    if penalty in (None, 1.0) or not seen:
        return
    idx = torch.tensor(sorted(set(seen)))
    vals = logits[idx]
    logits[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)


def draw(logits: torch.Tensor, temperature: float | None, generator: torch.Generator) -> int:
    """Greedy without a temperature, else one multinomial draw from `generator`."""
    if not temperature:
        return int(torch.argmax(logits))
    return int(torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=generator))


class Sampler:
    """The part of the executor each line implements differently (line12.py, line13.py)."""

    name = "sampler"

    def admit(self, r: Request) -> None:
        """A request enters a decoder slot."""

    def host_bias_bytes(self, active: list[Request]) -> int:
        """Bytes of embedding-bias rows built on the host and copied to the GPU in this step."""
        return 0

    def sample(self, active: list[Request], logits: torch.Tensor) -> list[int]:
        raise NotImplementedError


def checkpoint_vocab(model: str) -> int:
    """vocab_size of a local checkpoint's config.json, else the English finetune's."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return SPEC.vocab_size


class LLM:
    """Like llmapi/llm.py LLM with the PyTorch executor (_torch/pyexecutor/py_executor.py PyExecutor)."""

    instances: list[LLM] = []
    version = "0"
    context_chunks = 1  # chunked prefill splitting every prompt into this many steps (a test sets it)

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(self.validate(dict(kwargs))) - LLM_ARGS
        if unknown:
            raise TypeError(f"unexpected LLM arguments {unknown}")
        self.model = model
        self.kwargs = kwargs  # as passed
        self.sampler = self.make_sampler(kwargs)
        self.overlap = not kwargs.get("disable_overlap_scheduler", False)
        self.vocab = checkpoint_vocab(model)
        self.results: list[GenerationResult] = []
        self.calls: list[dict[str, Any]] = []
        self.active: list[GenerationResult] = []
        self.waiting: list[GenerationResult] = []
        self.host_bias_bytes_per_step: list[int] = []
        self.shut = False
        self._next_id = 0
        lora = kwargs.get("lora_config")
        assert lora is None or isinstance(lora, LoraConfig)
        self.lora_config: LoraConfig | None = lora
        self.loaded_loras: dict[str, str] = {}  # the worker's LoraManager: str(lora_int_id) -> the path loaded
        LLM.instances.append(self)

    def validate(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The line's llm_args handling of `sampler_type`; returns the other arguments."""
        return kwargs

    def make_sampler(self, kwargs: dict[str, Any]) -> Sampler:
        raise NotImplementedError

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming: bool = False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        scheduling_params=None,
    ) -> GenerationResult:
        assert isinstance(sampling_params, SamplingParams)
        assert lora_request is None or isinstance(lora_request, LoRARequest)
        call = {"inputs": inputs, "streaming": streaming}
        self.calls.append(call if lora_request is None else {**call, "lora_request": lora_request})
        self._next_id += 1
        worker_params = pickle.loads(pickle.dumps(sampling_params))  # proxy → worker: the worker's own copy
        request = Request(self._next_id, list(inputs), worker_params, self._lora_task(lora_request))
        result = GenerationResult(self, list(inputs), sampling_params, request)
        self.results.append(result)
        self.waiting.append(result)
        return result

    def _lora_task(self, lora_request: LoRARequest | None) -> int | None:
        """base_worker._enqueue_request: no LoRA manager (no lora_config), no LoRA; else load once per id."""
        if self.lora_config is None or lora_request is None:
            return None
        self.loaded_loras.setdefault(str(lora_request.adapter_id), lora_request.path)
        return lora_request.adapter_id

    def iterate(self) -> None:
        """One executor iteration: cancellations, admission, one sampled token per active request."""
        self.waiting = [r for r in self.waiting if not r.cancelled]  # dropped without a response
        for r in [r for r in self.active if r.cancelled]:
            self.active.remove(r)
            r.step([], "cancelled")
        while self.waiting and len(self.active) < self.kwargs.get("max_batch_size", 2048):
            r = self.waiting.pop(0)
            r.request.slot = min(set(range(len(self.active) + 1)) - {a.request.slot for a in self.active})
            r.request.context_left = self.context_chunks
            self.active.append(r)
            self.sampler.admit(r.request)
        requests = [r.request for r in self.active]
        logits = toy_logits(len(requests), self.vocab)
        lora_logits(logits, requests, self.loaded_loras)
        run_logits_processors(requests, logits)  # every scheduled row, context chunks included
        rows = [i for i, r in enumerate(requests) if r.context_left <= 1]
        for r in requests:
            r.context_left -= 1
        sampled = [requests[i] for i in rows]
        self.host_bias_bytes_per_step.append(self.sampler.host_bias_bytes(sampled))
        if not sampled:
            return
        tokens = self.sampler.sample(sampled, logits[torch.tensor(rows)])
        for result, r, token in zip([self.active[i] for i in rows], sampled, tokens, strict=True):
            r.visible = len(r.generated) if self.overlap else len(r.generated) + 1
            r.generated.append(token)
            p = r.params
            finish = "stop" if token == p.end_id else "length" if len(r.generated) >= p.max_tokens else None
            if finish is not None:
                self.active.remove(result)
            result.step([token], finish)

    def shutdown(self) -> None:
        self.shut = True
