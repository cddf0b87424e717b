"""Which TensorRT-LLM line is installed, told by what it can do rather than by its version string alone.

Two lines matter (upstream facts, read in the sources and PRs named; none of it ran here):
  * 1.2, the stable line (the Docker image's): `llm_args.SamplerType` has TRTLLMSampler, the C++ decoder that
    applies repetition_penalty and per-request seeds; the PyTorch backend's TorchSampler applies neither.
  * >= 1.3: TRTLLMSampler deprecated (NVIDIA/TensorRT-LLM#11938), then removed with `SamplerType`
    (NVIDIA/TensorRT-LLM#18232; "TRTLLMSampler" rejected, "auto"/"TorchSampler" ignored, #18513); TorchSampler
    applies the penalties (#16485, `_torch/pyexecutor/sampler/penalties.py`) and a per-request seed that
    `sampler/seed_manager.py` calls "not yet effective for batched requests" (#17172). The TensorRT engine-build
    flow (`tensorrt_llm/builder.py`, trtllm-build) ended after 1.3.0rc20 (#15918).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

TRTLLM_SAMPLER = "TRTLLMSampler"
TORCH_SAMPLER = "TorchSampler"
# Where TorchSampler's occurrence penalties live: their own module from #17701 on, inside sampler.py when #16485 landed.
_PENALTY_PROBES = (
    ("tensorrt_llm._torch.pyexecutor.sampler.penalties", "PenaltyHandler"),
    ("tensorrt_llm._torch.pyexecutor.sampler.sampler", "_OccurrencePenaltyHandler"),
)
_SEED_PROBE = ("tensorrt_llm._torch.pyexecutor.sampler.seed_manager", "_SeedManager")
_ENGINE_BUILD_PROBE = ("tensorrt_llm.builder", "Builder")
LAST_ENGINE_BUILD = (1, 3, 0, 20)  # 1.3.0rc20


def version_tuple(text: str) -> tuple[int, int, int, int]:
    """(major, minor, patch, rc) of "1.2.1" or "1.3.0rc24"; a final release sorts after its release candidates."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(?:rc(\d+))?", text)
    if not m:
        return (0, 0, 0, 0)
    major, minor, patch, rc = m.groups()
    return (int(major), int(minor), int(patch or 0), int(rc) if rc is not None else 1 << 30)


def _has(module: str, attr: str) -> bool:
    """True if `module` imports and has `attr`."""
    try:
        return hasattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 - a probe: anything that fails to import is absent
        return False


def _fields(cls: Any) -> frozenset[str]:
    """Field names of a dataclass such as `tensorrt_llm.SamplingParams`."""
    try:
        return frozenset(f.name for f in dataclasses.fields(cls))
    except TypeError:
        return frozenset()


@dataclass(frozen=True)
class TrtllmLine:
    """What the installed TensorRT-LLM can do, as far as this backend cares."""

    version: str
    trtllm_sampler: bool  # `sampler_type="TRTLLMSampler"` is accepted (llmapi/llm_args.py SamplerType)
    torch_penalties: bool  # TorchSampler applies repetition/presence/frequency penalties
    torch_seeds: bool  # TorchSampler has per-request seeds (sampler/seed_manager.py), effective only unbatched
    sampling_fields: frozenset[str]  # SamplingParams fields

    @property
    def sampler(self) -> str | None:
        """The sampler that applies repetition_penalty: TorchSampler where it can, else TRTLLMSampler, else None."""
        if self.torch_penalties:
            return TORCH_SAMPLER
        return TRTLLM_SAMPLER if self.trtllm_sampler else None

    def seeds(self, sampler: str | None) -> str:
        """What a request's seed does under `sampler`: per-request, best-effort or ignored."""
        if sampler == TRTLLM_SAMPLER:
            return "per-request"
        return "best-effort" if self.torch_seeds else "ignored"

    @property
    def logits_processor(self) -> bool:
        """True if SamplingParams takes a per-request `logits_processor` (PyTorch backend)."""
        return "logits_processor" in self.sampling_fields


def detect(tensorrt_llm: Any, sampling_params: Any) -> TrtllmLine:
    """Probe the imported `tensorrt_llm` package and its SamplingParams class."""
    try:
        from tensorrt_llm.llmapi.llm_args import SamplerType

        trtllm_sampler = TRTLLM_SAMPLER in getattr(SamplerType, "__members__", {})
    except ImportError:  # SamplerType went with TRTLLMSampler (#18232)
        trtllm_sampler = False
    return TrtllmLine(
        version=str(getattr(tensorrt_llm, "__version__", "0")),
        trtllm_sampler=trtllm_sampler,
        torch_penalties=any(_has(m, a) for m, a in _PENALTY_PROBES),
        torch_seeds=_has(*_SEED_PROBE),
        sampling_fields=_fields(sampling_params),
    )


def engine_build_missing() -> str | None:
    """One line saying why the installed TensorRT-LLM cannot build engines; None if it can, or none is installed."""
    try:
        trt = importlib.import_module("tensorrt_llm")
    except ModuleNotFoundError:
        return None  # nothing installed here: the checkpoint is for another machine
    except Exception:  # noqa: BLE001 - installed but unusable here (no CUDA): judge by its version
        try:
            version = metadata.version("tensorrt-llm")
        except metadata.PackageNotFoundError:
            return None
        build = version_tuple(version) <= LAST_ENGINE_BUILD
    else:
        version = str(getattr(trt, "__version__", "0"))
        build = _has(*_ENGINE_BUILD_PROBE)
    if build:
        return None
    return (
        f"--format trtllm writes a checkpoint for TensorRT-LLM's engine-build flow, which the installed "
        f"TensorRT-LLM {version} no longer has (it ended after 1.3.0rc20); use --format hf"
    )
