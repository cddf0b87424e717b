"""Token backends behind one protocol, built by name from an EngineConfig.

May import: root, runtime.
"""

from __future__ import annotations

from typing import Any

from ..config import BACKENDS, COMPLETIONS_BACKENDS, EngineConfig
from ..spec import ModelSpec, spec_for
from .protocol import BackendError, FinishReason, GenerationRequest, TokenBackend, TokenStream

__all__ = [
    "BackendError",
    "FinishReason",
    "GenerationRequest",
    "TokenBackend",
    "TokenStream",
    "make_backend",
    "make_tokenizer",
]


def make_backend(config: EngineConfig, spec: ModelSpec, device: str) -> TokenBackend:
    """The backend named by `config.backend`, imported only when chosen."""
    options: dict[str, Any] = dict(config.backend_options)
    name = config.backend
    if name == "synthetic":
        from .synthetic import SyntheticBackend

        return SyntheticBackend(config.synthetic, spec=spec, max_batch_size=config.batch_size, **options)
    if name in COMPLETIONS_BACKENDS:  # the server holds the model
        from .openai_completions import OpenAICompletionsBackend

        options.setdefault("tokenizer", config.tokenizer or config.model)
        return OpenAICompletionsBackend(config.completions_server, spec=spec, **options)
    if config.model is None:
        raise ValueError(f"backend {name!r} needs EngineConfig.model")
    if name == "hf":
        from .hf import HFBackend

        # On CUDA the eager step is bound by its ~1,000 kernel launches (H200: 50 ms a step at 1-64 rows, a
        # quarter of real time); its captured graphs take 4.8-6.2 ms (docs/benchmarks.md).
        options.setdefault("cuda_graphs", device.startswith("cuda"))
        return HFBackend(
            config.model,
            device=device,
            max_batch_size=config.batch_size,
            max_seq_len=config.max_seq_len,
            spec=spec,
            adapters=config.adapters,
            **options,
        )
    if name == "trtllm":
        from .trtllm import TrtllmBackend

        if config.adapters:
            options.setdefault("adapters", config.adapters)
        return TrtllmBackend(
            config.model, spec=spec, max_batch_size=config.batch_size, max_seq_len=config.max_seq_len, **options
        )
    if name == "vllm":
        from .vllm import VllmBackend

        if config.adapters:
            options.setdefault("adapters", config.adapters)
        return VllmBackend(
            config.model,
            spec=spec,
            tokenizer=config.tokenizer,
            max_batch_size=config.batch_size,
            max_seq_len=config.max_seq_len,
            **options,
        )
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


class ByteTokenizer:
    """Stand-in tokenizer for the synthetic backend when no model is given: BOS + one id per UTF-8 byte."""

    def __init__(self, bos: int):
        self.bos = bos

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [self.bos, *text.encode("utf-8")]}


def make_tokenizer(config: EngineConfig) -> Any:
    """The model's Hugging Face tokenizer (or a byte stand-in for a model-less synthetic engine)."""
    source = config.tokenizer or config.model
    if source is None:
        if config.backend != "synthetic":
            raise ValueError("EngineConfig.model (or .tokenizer) is required")
        return ByteTokenizer(spec_for(config.model_family).bos)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
