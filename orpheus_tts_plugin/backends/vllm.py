"""vLLM backend: the v1 engine's `AsyncLLM` with FP8 weights and FP8 KV cache, token-id prompts, delta outputs.

What has and has not run of it, and against what: docs/backends.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..mailbox import Mailbox
from ..spec import ENGLISH, ModelSpec
from .base import BackendError, FinishReason, GenerationRequest, RequestCounts, check_loop

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the vllm backend needs vLLM with the v1 engine (`pip install 'orpheus-tts-plugin[vllm]'` or "
    "`pip install vllm`) and a CUDA GPU; FP8 weights and FP8 KV cache need Ada or Hopper."
)
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def import_vllm() -> SimpleNamespace:
    """The vLLM classes this backend uses; ImportError saying how to get them if missing."""
    try:
        from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except (ImportError, OSError, RuntimeError) as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        SamplingParams=SamplingParams,
        TokensPrompt=TokensPrompt,
        RequestOutputKind=RequestOutputKind,
    )


def is_prequantized(model: str) -> bool:
    """True if a local checkpoint carries its own quantisation (e.g. ModelOpt FP8 from `orpheus-tts quantize`)."""
    root = Path(model)
    if (root / "hf_quant_config.json").is_file():
        return True
    try:
        return "quantization_config" in json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False


class VllmBackend:
    """Token generation on vLLM's AsyncLLM; one vLLM request per stream, aborted when the stream closes."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        spec: ModelSpec = ENGLISH,
        tokenizer: str | None = None,
        quantization: str | None = "fp8",
        kv_cache_dtype: str = "fp8",
        max_batch_size: int = 256,
        max_num_tokens: int = 16384,
        max_seq_len: int = 8192,
        gpu_memory_utilization: float = 0.9,
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
        self.constrain_audio = constrain_audio
        self.engine_kwargs = dict(engine_kwargs or {})
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._allowed = list(spec.audio_ids)
        self._requests = RequestCounts()

    def engine_args(self) -> Any:
        """`AsyncEngineArgs`: online FP8 unless the checkpoint is already quantised, FP8 KV cache."""
        quantization = None if is_prequantized(self.model) else self.quantization
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "quantization": quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "max_num_seqs": self.max_batch_size,
            "max_num_batched_tokens": self.max_num_tokens,
            "max_model_len": self.max_seq_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": True,
            "disable_log_stats": True,
        }
        kwargs.update(self.engine_kwargs)
        return self._v.AsyncEngineArgs(**kwargs)

    def sampling_params(self, req: GenerationRequest) -> Any:
        """vLLM `SamplingParams` of one request: delta outputs, ids only, stop at end of speech."""
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
            allowed_token_ids=self._allowed if constrained else None,
            output_kind=self._v.RequestOutputKind.DELTA,
        )

    async def start(self) -> None:
        if self._engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        args = self.engine_args()
        self._engine = await asyncio.to_thread(self._v.AsyncLLM.from_engine_args, args)

    def generate(self, req: GenerationRequest) -> VllmStream:
        check_loop(self._loop if self._engine is not None else None, self.name)
        prompt = self._v.TokensPrompt(prompt_token_ids=list(req.prompt_ids))
        outputs = self._engine.generate(prompt, self.sampling_params(req), req.request_id)
        self._requests.started()
        return VllmStream(self._engine, req, outputs, self.spec.stop_ids(req.stop_ids), self._requests)

    def stats(self) -> dict[str, Any]:
        return self._requests.stats(self.name)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


class VllmStream:
    """New ids of one vLLM request. A task pumps vLLM's generator, so `aclose()` can abort from any task."""

    def __init__(
        self, engine: Any, req: GenerationRequest, outputs: Any, stop_ids: tuple[int, ...], counts: RequestCounts
    ):
        self.req = req
        self.finish_reason: str | None = None
        self._engine = engine
        self._counts = counts
        self._stop = frozenset(stop_ids)
        self._box: Mailbox[list[int]] = Mailbox()
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
        self._box.end(error)
