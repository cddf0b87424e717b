"""TensorRT-LLM backend (LLM API, PyTorch backend): FP8 weights and FP8 KV cache on Hopper, the production path.

What has and has not run of it, and against what: docs/backends.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..spec import ENGLISH, ModelSpec
from .base import BackendError, FinishReason, GenerationRequest, RequestCounts, check_loop

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the trtllm backend needs TensorRT-LLM >= 1.2 (PyTorch backend), which needs CUDA at import and "
    "Python 3.10 or 3.12. Its wheel is served from NVIDIA's index, not PyPI: "
    "`pip install 'tensorrt-llm>=1.2' --extra-index-url https://pypi.nvidia.com`; or run inside the release "
    "container nvcr.io/nvidia/tensorrt-llm/release:1.2.1 (see docker/ in this repository)."
)
# Added to the logits of every id that is not audio or end of speech: exp(-1e4) is exactly 0 in fp32,
# and unlike -inf it cannot turn into NaN inside penalty or top-p kernels, and it fits fp16.
FORBIDDEN_BIAS = -1.0e4
# TensorRT-LLM's CompletionOutput.finish_reason → ours.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORTED}


def import_trtllm() -> SimpleNamespace:
    """The TensorRT-LLM classes this backend uses; ImportError saying how to get them if missing."""
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except (ImportError, OSError, RuntimeError) as exc:  # OSError/RuntimeError: installed, but no CUDA
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    try:
        from tensorrt_llm.llmapi import CudaGraphConfig
    except ImportError:  # renamed after 1.2
        from tensorrt_llm.llmapi import DecodeCudaGraphConfig as CudaGraphConfig
    return SimpleNamespace(
        LLM=LLM, SamplingParams=SamplingParams, KvCacheConfig=KvCacheConfig, CudaGraphConfig=CudaGraphConfig
    )


def audio_bias(spec: ModelSpec, vocab_size: int) -> Any:
    """fp32 [vocab_size] embedding bias: 0 on audio ids and end of speech, FORBIDDEN_BIAS elsewhere."""
    import torch

    if vocab_size < spec.audio_token_end:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the audio id range end {spec.audio_token_end}")
    bias = torch.full((vocab_size,), FORBIDDEN_BIAS, dtype=torch.float32)
    bias[list(spec.audio_ids)] = 0.0
    return bias


def read_vocab_size(model: str) -> int | None:
    """vocab_size from a local checkpoint's config.json (None for hub ids or when absent)."""
    path = Path(model) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
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
        kv_cache_dtype: str = "fp8",
        cuda_graph_batch_sizes: Sequence[int] | None = None,
        enable_chunked_prefill: bool = True,
        constrain_audio: bool = True,
        vocab_size: int | None = None,
        skip_tokenizer_init: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        self._t = import_trtllm()
        if max_batch_size < 1 or max_num_tokens < 1 or max_seq_len < 1:
            raise ValueError("max_batch_size, max_num_tokens and max_seq_len must be >= 1")
        if not 0.0 < kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
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
        self.llm_kwargs = dict(llm_kwargs or {})
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bias: Any = None
        self._requests = RequestCounts()

    def llm_args(self) -> dict[str, Any]:
        """Keyword arguments of `tensorrt_llm.LLM` (PyTorch backend, FP8 KV cache, CUDA graphs)."""
        t = self._t
        if self.cuda_graph_batch_sizes:
            graphs = t.CudaGraphConfig(batch_sizes=self.cuda_graph_batch_sizes, enable_padding=True)
        else:
            graphs = t.CudaGraphConfig(max_batch_size=self.max_batch_size, enable_padding=True)
        args: dict[str, Any] = {
            "model": self.model,
            "kv_cache_config": t.KvCacheConfig(
                dtype=self.kv_cache_dtype, free_gpu_memory_fraction=self.kv_cache_fraction
            ),
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "cuda_graph_config": graphs,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "skip_tokenizer_init": self.skip_tokenizer_init,
        }
        args.update(self.llm_kwargs)
        return args

    def sampling_params(self, req: GenerationRequest) -> Any:
        """The `tensorrt_llm.SamplingParams` of one request: ids out only, stop at end of speech."""
        s = req.sampling
        stop = list(self.spec.stop_ids(req.stop_ids))
        return self._t.SamplingParams(
            max_tokens=req.max_new_tokens,
            end_id=self.spec.end_of_speech,
            pad_id=self.spec.pad,
            stop_token_ids=stop,
            temperature=s.temperature,
            top_p=s.top_p,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
            detokenize=False,
            embedding_bias=self._bias if (req.constrain_audio and self.constrain_audio) else None,
        )

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.constrain_audio:
            vocab = self.vocab_size or read_vocab_size(self.model) or self.spec.vocab_size
            self._bias = audio_bias(self.spec, vocab)  # one tensor shared by every constrained request
        self._llm = await asyncio.to_thread(self._t.LLM, **self.llm_args())

    def generate(self, req: GenerationRequest) -> TrtllmStream:
        check_loop(self._loop if self._llm is not None else None, self.name)
        params = self.sampling_params(req)
        try:
            result = self._llm.generate_async(list(req.prompt_ids), sampling_params=params, streaming=True)
        except Exception as exc:  # a rejected request must not take the engine down
            self._requests.failed_to_start()
            raise BackendError(f"trtllm rejected request {req.request_id}: {exc}") from exc
        self._requests.started()
        return TrtllmStream(req, result, self.spec.stop_ids(req.stop_ids), self._requests)

    def stats(self) -> dict[str, Any]:
        return self._requests.stats(self.name)

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)


class TrtllmStream:
    """New ids of one TensorRT-LLM request (`token_ids_diff` per step); `aclose()` calls `result.abort()`."""

    def __init__(self, req: GenerationRequest, result: Any, stop_ids: tuple[int, ...], counts: RequestCounts):
        self.req = req
        self.result = result
        self.finish_reason: str | None = None
        self._counts = counts
        self._stop = frozenset(stop_ids)

    def __aiter__(self) -> TrtllmStream:
        return self

    async def __anext__(self) -> list[int]:
        while self.finish_reason is None:
            try:
                out = await self.result.__anext__()
            except StopAsyncIteration:
                self._finish(FinishReason.ERROR)  # ended without a finished output
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reported as a backend failure
                if self.finish_reason is not None:  # closed while waiting
                    break
                self._finish(FinishReason.ERROR)
                raise BackendError(f"trtllm request {self.req.request_id} failed: {exc}") from exc
            if self.finish_reason is not None:  # closed while waiting
                break
            completion = out.outputs[0]
            ids = list(completion.token_ids_diff)
            if out.finished:
                if ids and ids[-1] in self._stop:
                    ids.pop()
                self._finish(_FINISH.get(completion.finish_reason, FinishReason.ERROR))
            if ids:
                self._counts.add_tokens(len(ids))
                return ids
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Abort the request in TensorRT-LLM (dropping the iterator alone does not)."""
        if self.finish_reason is None:
            self._finish(FinishReason.ABORTED)
            try:
                self.result.abort()
            except Exception:  # the request may have finished meanwhile
                log.debug("trtllm abort of %s failed", self.req.request_id, exc_info=True)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._counts.ended(reason)
