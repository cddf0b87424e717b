"""TensorRT-LLM backend (LLM API, PyTorch backend): FP8 weights and FP8 KV cache on Hopper, the production path.

TensorRT-LLM never ran in this project (no GPU, no NVIDIA index): everything here is written against the upstream
sources of two lines and checked only against stand-ins of them (tests/trtllm_standin/). What that means:
docs/backends.md.

Sampler, by what the installed TensorRT-LLM can do (trtllm_lines.py): on 1.2 TorchSampler applies neither
`repetition_penalty` nor per-request seeds, so this backend asks for TRTLLMSampler (the C++ decoder: penalties and
seeds in its kernels, the bias copied once per request into its slot). From 1.3 TorchSampler applies the penalties
and TRTLLMSampler is gone, so TorchSampler it is, with seeds that upstream says work only for a request sampled
alone. A release with neither is refused (see `import_trtllm`).

LoRA adapters (`adapters`, EngineConfig.adapters): `LLM(lora_config=LoraConfig(lora_dir=[every folder], max_lora_rank,
max_loras, max_cpu_loras))` and `generate_async(..., lora_request=LoRARequest(name, id, folder))` per request, the
PyTorch backend's multi-LoRA path (upstream docs/source/features/lora.md); written against upstream, run only on the
stand-in.

Audio constraint: the per-frame-position logits processor (trtllm_logits.py) where its per-step host cost at the
configured batch is small or no larger than the union mask's, else the union of all audio ids as one embedding bias.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ..spec import ENGLISH, ModelSpec
from .checkpoint import checkpoint_json, checkpoint_quantization
from .lora_adapters import LoraAdapter, adapter_of, read_adapters
from .protocol import BackendError, FinishReason, GenerationRequest, check_loop
from .pumped import PumpedStream, RequestCounts
from .trtllm_lines import TORCH_SAMPLER, TRTLLM_SAMPLER, TrtllmLine, detect, version_tuple
from .trtllm_logits import FORBIDDEN, AudioPositionProcessor

log = logging.getLogger(__name__)

MIN_TRTLLM = (1, 2)
INSTALL_HINT = (
    "the trtllm backend needs TensorRT-LLM >= 1.2 (PyTorch backend), which needs CUDA at import and Python 3.10 or "
    "3.12. Its wheel is served from NVIDIA's index, not PyPI: "
    "`pip install 'tensorrt-llm>=1.2' --extra-index-url https://pypi.nvidia.com`; or run inside the release "
    "container nvcr.io/nvidia/tensorrt-llm/release:1.2.1 (see docker/ in this repository)."
)
NO_SAMPLER = (
    "TensorRT-LLM {version} has neither TRTLLMSampler nor a TorchSampler that applies repetition_penalty, which "
    "Orpheus needs (>= 1.1) for stable speech. Use TensorRT-LLM 1.2 or >= 1.3.0rc26, or pass "
    "llm_kwargs={{'sampler_type': ...}}."
)
FORBIDDEN_BIAS = FORBIDDEN  # added to every id that is not audio or end of speech (see trtllm_logits.py)
# TensorRT-LLM's CompletionOutput.finish_reason → ours; 'timeout' (tllm.FinishReason.TIMED_OUT) fails the stream.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORTED}
CONSTRAINTS = ("auto", "position", "union")
# Host milliseconds per engine step, measured on the stand-in (tests/trtllm_standin/cost.py, docs/backends.md):
# the position processor ~0.05 per row with upstream's dispatch, plus ~0.04 for the history copy upstream makes
# through its bindings for every processor call; TorchSampler's bias rows stacked on the host, 0.6-0.7 per MB at
# 64-256 rows, plus the copy to the GPU (~0.04 per MB at 25 GB/s). Under TRTLLMSampler a bias costs 0 per step.
POSITION_MS_PER_ROW = 0.1
TORCH_BIAS_MS_PER_MB = 0.65
CONSTRAINT_BUDGET_MS = 2.0  # host time per step the position processor may take whatever the union would cost


class TrtllmTimeoutError(BackendError):
    """TensorRT-LLM ended a request with finish_reason 'timeout' (its FinishReason.TIMED_OUT)."""


def import_trtllm(need_sampler: bool = True) -> SimpleNamespace:
    """The TensorRT-LLM classes this backend uses and its line; ImportError in one line if missing or unusable."""
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except (ImportError, OSError, RuntimeError) as exc:  # OSError/RuntimeError: installed, but no CUDA
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    line = detect(tensorrt_llm, SamplingParams)
    if version_tuple(line.version)[:2] < MIN_TRTLLM:
        raise ImportError(f"{INSTALL_HINT}; found TensorRT-LLM {line.version}")
    if need_sampler and line.sampler is None:
        raise ImportError(NO_SAMPLER.format(version=line.version))
    try:
        from tensorrt_llm.llmapi import CudaGraphConfig
    except ImportError:  # renamed after 1.2
        from tensorrt_llm.llmapi import DecodeCudaGraphConfig as CudaGraphConfig
    return SimpleNamespace(
        LLM=LLM, SamplingParams=SamplingParams, KvCacheConfig=KvCacheConfig, CudaGraphConfig=CudaGraphConfig, line=line
    )


def import_trtllm_lora() -> SimpleNamespace:
    """TensorRT-LLM's LoRA classes: `LoraConfig` (lora_manager.py, defined in lora_helper.py from 1.0) and
    `LoRARequest` (executor/request.py), where upstream's LoRA guide imports them."""
    try:
        from tensorrt_llm.executor.request import LoRARequest
        from tensorrt_llm.lora_manager import LoraConfig
    except ImportError as exc:
        raise ImportError(f"this TensorRT-LLM has no LoRA API (LoraConfig, LoRARequest): {exc}") from exc
    return SimpleNamespace(LoraConfig=LoraConfig, LoRARequest=LoRARequest)


def constraint_cost_ms(kind: str, rows: int, vocab_size: int, sampler: str) -> float:
    """Estimated host milliseconds per engine step of an audio constraint at `rows` live requests."""
    if kind == "position":
        return rows * POSITION_MS_PER_ROW
    if kind == "union" and sampler != TRTLLM_SAMPLER:
        return rows * vocab_size * 4 / 1e6 * TORCH_BIAS_MS_PER_MB
    return 0.0


def choose_constraint(requested: str, rows: int, vocab_size: int, sampler: str, line: TrtllmLine) -> str:
    """What `requested` ("auto", "position" or "union") resolves to at `rows` rows under `sampler`."""
    if requested not in CONSTRAINTS:
        raise ValueError(f"audio_constraint must be one of {CONSTRAINTS}, got {requested!r}")
    if requested == "position" and not line.logits_processor:
        raise ValueError(f"audio_constraint='position': TensorRT-LLM {line.version} has no logits_processor")
    if requested != "auto":
        return requested
    if not line.logits_processor:
        return "union"
    position = constraint_cost_ms("position", rows, vocab_size, sampler)
    union = constraint_cost_ms("union", rows, vocab_size, sampler)
    return "position" if position <= CONSTRAINT_BUDGET_MS or position <= union else "union"


def audio_bias(spec: ModelSpec, vocab_size: int) -> Any:
    """fp32 [vocab_size] embedding bias: 0 on audio ids and end of speech, FORBIDDEN_BIAS elsewhere."""
    import torch

    if vocab_size < spec.audio_token_end:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the audio id range end {spec.audio_token_end}")
    bias = torch.full((vocab_size,), FORBIDDEN_BIAS, dtype=torch.float32)
    bias[list(spec.audio_ids)] = 0.0
    return bias


def read_vocab_size(model: str) -> int | None:
    """vocab_size from a checkpoint's config.json, local or in the hub cache (None when it cannot be read)."""
    try:
        return int((checkpoint_json(model, "config.json") or {})["vocab_size"])
    except (LookupError, OSError, ValueError, TypeError):
        return None


class TrtllmBackend:
    """Token generation on the TensorRT-LLM LLM API, one in-flight-batched request per stream."""

    name = "trtllm"

    def __init__(
        self,
        model: str,
        *,
        spec: ModelSpec = ENGLISH,
        max_batch_size: int = 256,
        max_num_tokens: int = 16384,
        max_seq_len: int = 8192,
        kv_cache_fraction: float = 0.9,
        kv_cache_dtype: str | None = None,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
        enable_chunked_prefill: bool = True,
        constrain_audio: bool = True,
        audio_constraint: str = "auto",
        vocab_size: int | None = None,
        skip_tokenizer_init: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
        adapters: Sequence[tuple[str, str]] = (),
    ):
        self.llm_kwargs = dict(llm_kwargs or {})
        self._t = import_trtllm(need_sampler="sampler_type" not in self.llm_kwargs)
        if max_batch_size < 1 or max_num_tokens < 1 or max_seq_len < 1:
            raise ValueError("max_batch_size, max_num_tokens and max_seq_len must be >= 1")
        if not 0.0 < kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
        self.line: TrtllmLine = self._t.line
        chosen = self.llm_kwargs.get("sampler_type", self.line.sampler)
        self.sampler = TORCH_SAMPLER if chosen in (None, "auto") else str(chosen)
        vocab = vocab_size or spec.vocab_size
        self.audio_constraint = (
            choose_constraint(audio_constraint, max_batch_size, vocab, self.sampler, self.line)
            if constrain_audio
            else "none"
        )
        self.model = model
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len
        self.kv_cache_fraction = kv_cache_fraction
        self.kv_cache_dtype = kv_cache_dtype
        self.cuda_graph_batch_sizes = list(cuda_graph_batch_sizes) if cuda_graph_batch_sizes else None
        self.enable_chunked_prefill = enable_chunked_prefill
        self.constrain_audio = constrain_audio
        self.vocab_size = vocab_size
        self.skip_tokenizer_init = skip_tokenizer_init
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bias: Any = None
        self._requests = RequestCounts(pausable=True)
        self.adapters = tuple(sorted(adapters))  # (name, PEFT folder or hub id): EngineConfig.adapters
        self.loras: dict[str, LoraAdapter] = {}  # read at start: name -> folder, id, rank
        self._lora_requests: dict[str, Any] = {}  # name -> its LoRARequest, one object for every request

    def resolved_kv_cache_dtype(self) -> str:
        """`kv_cache_dtype`, else "auto" for a checkpoint with a calibrated KV cache (or unknown), else "fp8"."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        quant = checkpoint_quantization(self.model)
        if quant is None:
            log.info("trtllm: cannot read %s's config; KV cache dtype 'auto' (the checkpoint's own)", self.model)
            return "auto"
        # "auto" takes the checkpoint's kv_cache_quant_algo with its calibrated scales; "fp8" would override them.
        return "auto" if quant.kv_cache else "fp8"

    def constraint_ms_per_step(self) -> float:
        """Estimated host milliseconds per engine step that the audio constraint costs at `max_batch_size` rows."""
        vocab = self.vocab_size or self.spec.vocab_size
        return constraint_cost_ms(self.audio_constraint, self.max_batch_size, vocab, self.sampler)

    def llm_args(self) -> dict[str, Any]:
        """Keyword arguments of `tensorrt_llm.LLM` (PyTorch backend, the line's sampler, KV cache, CUDA graphs)."""
        t = self._t
        if self.cuda_graph_batch_sizes:
            graphs = t.CudaGraphConfig(batch_sizes=self.cuda_graph_batch_sizes, enable_padding=True)
        else:
            graphs = t.CudaGraphConfig(max_batch_size=self.max_batch_size, enable_padding=True)
        args: dict[str, Any] = {
            "model": self.model,
            # Block reuse (its default, said here): a cloned voice's reference turn, the same leading blocks of every
            # prompt of that voice, is computed once; a resumed request's filled blocks are reused too.
            "kv_cache_config": t.KvCacheConfig(
                dtype=self.resolved_kv_cache_dtype(),
                free_gpu_memory_fraction=self.kv_cache_fraction,
                enable_block_reuse=True,
            ),
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "cuda_graph_config": graphs,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "skip_tokenizer_init": self.skip_tokenizer_init,
        }
        if self.sampler == TRTLLM_SAMPLER:
            args["sampler_type"] = TRTLLM_SAMPLER  # >= 1.3 rejects the name; "auto" (the default) is TorchSampler
        if self.loras:
            args["lora_config"] = self.lora_config()
        args.update(self.llm_kwargs)
        return args

    def lora_config(self) -> Any:
        """`LoraConfig` of the adapters: every folder in `lora_dir` (upstream reads their target modules from it),
        the largest rank, and room for all of them on the GPU (`max_loras`) and in host memory (`max_cpu_loras`)."""
        lora = import_trtllm_lora()
        adapters = list(self.loras.values())
        return lora.LoraConfig(
            lora_dir=[a.path for a in adapters],
            max_lora_rank=max(a.rank for a in adapters),
            max_loras=len(adapters),
            max_cpu_loras=len(adapters),
        )

    def lora_request(self, req: GenerationRequest) -> Any:
        """The `LoRARequest` of `req`'s adapter (a continuation keeps its request's), None for the base model."""
        adapter = adapter_of(self.loras, req, self.name)
        return None if adapter is None else self._lora_requests[adapter.name]

    def sampling_params(self, req: GenerationRequest, audio_offset: int = 0) -> Any:
        """The `tensorrt_llm.SamplingParams` of one request: ids out only, end at end of speech.

        `audio_offset`: the ids its stream generated before this request (a continuation after a pause), from
        which the position processor's frame positions go on.
        """
        s = req.sampling
        # end_id already ends the request in the decoder; listing it as a stop id again only adds stop checks.
        stop = [i for i in self.spec.stop_ids(req.stop_ids) if i != self.spec.end_of_speech]
        constraint: dict[str, Any] = {}
        if req.constrain_audio and self.audio_constraint == "union":
            constraint["embedding_bias"] = self._bias
        elif req.constrain_audio and self.audio_constraint == "position":
            overlap = not self.llm_kwargs.get("disable_overlap_scheduler", False)
            # one per request
            constraint["logits_processor"] = AudioPositionProcessor(self.spec, overlap=overlap, offset=audio_offset)
        return self._t.SamplingParams(
            max_tokens=req.max_new_tokens,
            end_id=self.spec.end_of_speech,
            pad_id=self.spec.pad,
            stop_token_ids=stop or None,
            temperature=s.temperature,
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
            detokenize=False,
            **constraint,
        )

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.audio_constraint == "union":
            vocab = self.vocab_size or read_vocab_size(self.model) or self.spec.vocab_size
            self._bias = audio_bias(self.spec, vocab)  # one tensor for every constrained request
        self.loras = await asyncio.to_thread(read_adapters, self.adapters)
        if self.loras:
            # Upstream takes any int id, 0 included, and loads an adapter once per id (its worker's
            # _load_lora_adapter keys the PEFT cache by str(id)): ids 1, 2, ... fixed for the backend's life.
            lora = import_trtllm_lora()
            self._lora_requests = {name: lora.LoRARequest(name, a.int_id, a.path) for name, a in self.loras.items()}
        self._llm = await asyncio.to_thread(self._t.LLM, **self.llm_args())
        cost = self.constraint_ms_per_step()
        level = logging.WARNING if cost > CONSTRAINT_BUDGET_MS else logging.INFO
        log.log(
            level,
            "trtllm: TensorRT-LLM %s, %s, seeds %s, audio constraint %s (~%.1f ms of host time per step at %d rows)",
            self.line.version,
            self.sampler,
            self.line.seeds(self.sampler),
            self.audio_constraint,
            cost,
            self.max_batch_size,
        )

    def generate(self, req: GenerationRequest) -> TrtllmStream:
        check_loop(self._loop if self._llm is not None else None, self.name)
        adapter_of(self.loras, req, self.name)  # an unknown adapter is the caller's error, not trtllm's
        try:
            result = self._submit(req)
        except Exception as exc:  # a rejected request must not take the engine down
            self._requests.failed_to_start()
            raise BackendError(f"trtllm rejected request {req.request_id}: {exc}") from exc
        self._requests.started()
        return TrtllmStream(self, req, result)

    def _submit(self, req: GenerationRequest, audio_offset: int = 0) -> Any:
        """Hand `req` to TensorRT-LLM, streaming; its result."""
        if self._llm is None:
            raise BackendError(f"{self.name} backend is closed")
        params = self.sampling_params(req, audio_offset)
        lora = self.lora_request(req)
        return self._llm.generate_async(list(req.prompt_ids), sampling_params=params, lora_request=lora, streaming=True)

    def stats(self) -> dict[str, Any]:
        return self._requests.stats(
            self.name,
            sampler=self.sampler,
            seeds=self.line.seeds(self.sampler),
            audio_constraint=self.audio_constraint,
        )

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)


class TrtllmStream(PumpedStream):
    """New ids of one TensorRT-LLM request (`token_ids_diff` per step), pumped by a task into a mailbox.

    `aclose()` ends the mailbox itself and calls `result.abort()`: TensorRT-LLM sends no final output for a request
    aborted while it still waits in the executor's queue, so a consumer waiting for one would wait forever. A pause
    aborts the same way and a resume submits the continuation (PumpedStream) as a new result; with KV block reuse
    (KvCacheConfig's default) its prompt's filled blocks, generated ids included, are reused rather than recomputed.
    """

    name = "trtllm"
    finish_reasons = _FINISH

    def __init__(self, backend: TrtllmBackend, req: GenerationRequest, result: Any):
        self._backend = backend
        self.result = result  # the current attempt's
        super().__init__(req, result, backend.spec.stop_ids(req.stop_ids), backend._requests)

    def _new_ids(self, completion: Any) -> list[int]:
        return completion.token_ids_diff

    def _push(self, ids: list[int], finish: str | None, error: BaseException | None = None) -> None:
        """A final output whose finish reason is not ours fails the stream with a typed error that names it."""
        if finish == FinishReason.ERROR and error is None:
            reason = self.result.outputs[0].finish_reason if self.result.finished else None
            if reason == "timeout":
                error = TrtllmTimeoutError(f"TensorRT-LLM timed out request {self.req.request_id}")
            elif reason is None:
                error = BackendError(f"trtllm request {self.req.request_id} ended without a final output")
            else:
                error = BackendError(f"trtllm request {self.req.request_id} ended with finish_reason {reason!r}")
        super()._push(ids, finish, error)

    def _abort(self) -> None:
        """Dropping the iterator alone does not abort in TensorRT-LLM; `abort()` marks the request, at once."""
        self.result.abort()

    def _resubmit(self, req: GenerationRequest, audio_offset: int) -> Any:
        self.result = self._backend._submit(req, audio_offset)
        return self.result
