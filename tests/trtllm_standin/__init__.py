"""Stand-ins for the two TensorRT-LLM lines this backend supports, installed as `tensorrt_llm` into sys.modules.

TensorRT-LLM cannot run here (no CUDA; the wheel is on NVIDIA's index), so the backend is tested against these.
Each imitates the upstream code of its line on the points the backend depends on, surprises included, and names it:
api.py (what both share), line12.py (1.2), line13.py (>= 1.3). They imitate behaviour; no upstream code is copied.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from .api import LLM, CudaGraphConfig, KvCacheConfig, LoraConfig, LoRARequest, SamplingParams
from .line12 import LLM12, SamplerType
from .line13 import LLM13, LLM13rc, PenaltyHandler, SeedManager

__all__ = ["LINES", "LLM", "CudaGraphConfig", "KvCacheConfig", "LoRARequest", "LoraConfig", "SamplerType", "install"]


@dataclass(frozen=True)
class Line:
    """What a line's `tensorrt_llm` package holds."""

    version: str
    llm: type[LLM]
    sampler_type: type | None  # llmapi/llm_args.py SamplerType, gone in >= 1.3
    torch_sampler_modules: bool  # _torch/pyexecutor/sampler/{penalties,seed_manager}.py
    builder: bool  # tensorrt_llm/builder.py (the TensorRT engine-build flow)


LINES = {
    "1.2": Line("1.2.1", LLM12, SamplerType, torch_sampler_modules=False, builder=True),
    "1.3": Line("1.3.0rc26", LLM13, None, torch_sampler_modules=True, builder=False),
    "1.3rc": Line("1.3.0rc24", LLM13rc, SamplerType, torch_sampler_modules=True, builder=False),
}


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def install(monkeypatch: pytest.MonkeyPatch, line: str) -> types.ModuleType:
    """Put the stand-in of `line` ("1.2", "1.3", "1.3rc") in sys.modules as `tensorrt_llm`; returns the root module."""
    spec = LINES[line]
    root = _module(monkeypatch, "tensorrt_llm", __version__=spec.version, LLM=spec.llm, SamplingParams=SamplingParams)
    llmapi = _module(monkeypatch, "tensorrt_llm.llmapi", KvCacheConfig=KvCacheConfig, CudaGraphConfig=CudaGraphConfig)
    llm_args = _module(monkeypatch, "tensorrt_llm.llmapi.llm_args")
    if spec.sampler_type is not None:
        llm_args.SamplerType = spec.sampler_type
    root.llmapi, llmapi.llm_args = llmapi, llm_args
    # LoRA, where upstream's guide (docs/source/features/lora.md) imports it from, in both lines.
    root.lora_helper = _module(monkeypatch, "tensorrt_llm.lora_helper", LoraConfig=LoraConfig)
    root.lora_manager = _module(monkeypatch, "tensorrt_llm.lora_manager", LoraConfig=LoraConfig)
    root.executor = _module(monkeypatch, "tensorrt_llm.executor")
    root.executor.request = _module(monkeypatch, "tensorrt_llm.executor.request", LoRARequest=LoRARequest)
    if spec.builder:
        root.builder = _module(monkeypatch, "tensorrt_llm.builder", Builder=type("Builder", (), {}))
    if spec.torch_sampler_modules:
        sampler = "tensorrt_llm._torch.pyexecutor.sampler"
        for name in ("tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor", sampler):
            _module(monkeypatch, name)
        _module(monkeypatch, f"{sampler}.penalties", PenaltyHandler=PenaltyHandler)
        _module(monkeypatch, f"{sampler}.seed_manager", _SeedManager=SeedManager)
    monkeypatch.setattr(LLM, "instances", [])
    return root
