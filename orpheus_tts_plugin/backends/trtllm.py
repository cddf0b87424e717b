"""TensorRT-LLM backend (LLM API, PyTorch backend): FP8 weights and FP8 KV cache on Hopper, the production path.

TensorRT-LLM never ran in this project (no GPU, no NVIDIA index): everything here is written against the upstream
1.2 sources and checked only against a stand-in (tests/test_backend_trtllm.py). What that means: docs/backends.md.

Sampler: the PyTorch backend's default (`sampler_type="auto"` → TorchSampler in 1.2) applies neither
`repetition_penalty` nor a per-request seed, and adds every request's embedding-bias row to a pinned host tensor
copied to the GPU each step. This backend asks for TRTLLMSampler (the C++ decoder): penalties and per-request seeds
in its kernels, the bias copied once per request into its per-slot device buffer. Releases without TRTLLMSampler
are refused (see `import_trtllm`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ..spec import ENGLISH, ModelSpec
from .base import BackendError, FinishReason, GenerationRequest, PumpedStream, RequestCounts, check_loop
from .checkpoint import checkpoint_json, checkpoint_quantization

log = logging.getLogger(__name__)

MIN_TRTLLM = (1, 2)
INSTALL_HINT = (
    "the trtllm backend needs TensorRT-LLM >= 1.2 (PyTorch backend) with its TRTLLMSampler, which needs CUDA at "
    "import and Python 3.10 or 3.12. Its wheel is served from NVIDIA's index, not PyPI: "
    "`pip install 'tensorrt-llm>=1.2' --extra-index-url https://pypi.nvidia.com`; or run inside the release "
    "container nvcr.io/nvidia/tensorrt-llm/release:1.2.1 (see docker/ in this repository)."
)
# The sampler that applies repetition_penalty and per-request seeds (tensorrt_llm/llmapi/llm_args.py SamplerType).
SAMPLER = "TRTLLMSampler"
NO_SAMPLER = (
    "TensorRT-LLM {version} has no TRTLLMSampler (its docs: deprecated in 1.3.0rc24, removed by 1.3.0rc26), and "
    "its TorchSampler does not yet apply per-request seeds when requests share a batch "
    "(_torch/pyexecutor/sampler/seed_manager.py): seeded Orpheus streams would not repeat. Use TensorRT-LLM 1.2 "
    "or a 1.3 release candidate that still has TRTLLMSampler, or pass llm_kwargs={{'sampler_type': ...}}."
)
# Added to the logits of every id that is not audio or end of speech: exp(-1e4) is exactly 0 in fp32,
# and unlike -inf it cannot turn into NaN inside penalty or top-p kernels, and it fits fp16.
FORBIDDEN_BIAS = -1.0e4
# TensorRT-LLM's CompletionOutput.finish_reason → ours.
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.ABORTED}


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "1.2.1" or "1.3.0rc24"."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def import_trtllm(need_sampler: bool = True) -> SimpleNamespace:
    """The TensorRT-LLM classes this backend uses; ImportError in one line if missing, too old or samplerless."""
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except (ImportError, OSError, RuntimeError) as exc:  # OSError/RuntimeError: installed, but no CUDA
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    version = getattr(tensorrt_llm, "__version__", "0")
    if _version(version) < MIN_TRTLLM:
        raise ImportError(f"{INSTALL_HINT}; found TensorRT-LLM {version}")
    if need_sampler and not _has_trtllm_sampler():
        raise ImportError(NO_SAMPLER.format(version=version))
    try:
        from tensorrt_llm.llmapi import CudaGraphConfig
    except ImportError:  # renamed after 1.2
        from tensorrt_llm.llmapi import DecodeCudaGraphConfig as CudaGraphConfig
    return SimpleNamespace(
        LLM=LLM, SamplingParams=SamplingParams, KvCacheConfig=KvCacheConfig, CudaGraphConfig=CudaGraphConfig
    )


def _has_trtllm_sampler() -> bool:
    """True if `LLM(sampler_type="TRTLLMSampler")` is accepted by the installed TensorRT-LLM."""
    try:
        from tensorrt_llm.llmapi.llm_args import SamplerType
    except ImportError:
        return False
    return SAMPLER in getattr(SamplerType, "__members__", {})


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
        vocab_size: int | None = None,
        skip_tokenizer_init: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        self.llm_kwargs = dict(llm_kwargs or {})
        self._t = import_trtllm(need_sampler="sampler_type" not in self.llm_kwargs)
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
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bias: Any = None
        self._requests = RequestCounts()

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

    def llm_args(self) -> dict[str, Any]:
        """Keyword arguments of `tensorrt_llm.LLM` (PyTorch backend, TRTLLMSampler, KV cache dtype, CUDA graphs)."""
        t = self._t
        if self.cuda_graph_batch_sizes:
            graphs = t.CudaGraphConfig(batch_sizes=self.cuda_graph_batch_sizes, enable_padding=True)
        else:
            graphs = t.CudaGraphConfig(max_batch_size=self.max_batch_size, enable_padding=True)
        args: dict[str, Any] = {
            "model": self.model,
            "kv_cache_config": t.KvCacheConfig(
                dtype=self.resolved_kv_cache_dtype(), free_gpu_memory_fraction=self.kv_cache_fraction
            ),
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens,
            "max_seq_len": self.max_seq_len,
            "cuda_graph_config": graphs,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "sampler_type": SAMPLER,
        }
        args.update(self.llm_kwargs)
        return args

    def sampling_params(self, req: GenerationRequest) -> Any:
        """The `tensorrt_llm.SamplingParams` of one request: ids out only, end at end of speech."""
        s = req.sampling
        # end_id already ends the request in the decoder; listing it as a stop id again only adds stop checks.
        stop = [i for i in self.spec.stop_ids(req.stop_ids) if i != self.spec.end_of_speech]
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


class TrtllmStream(PumpedStream):
    """New ids of one TensorRT-LLM request (`token_ids_diff` per step), pumped by a task into a mailbox.

    `aclose()` ends the mailbox itself and calls `result.abort()`: TensorRT-LLM sends no final output for a request
    aborted while it still waits in the executor's queue, so a consumer waiting for one would wait forever.
    """

    name = "trtllm"
    finish_reasons = _FINISH

    def __init__(self, req: GenerationRequest, result: Any, stop_ids: tuple[int, ...], counts: RequestCounts):
        self.result = result
        super().__init__(req, result, stop_ids, counts)

    def _new_ids(self, completion: Any) -> list[int]:
        return completion.token_ids_diff

    async def _abort(self) -> None:
        """Dropping the iterator alone does not abort in TensorRT-LLM."""
        self.result.abort()
