"""TensorRT-LLM 1.2 (the stable line, the release:1.2.x image): its samplers as this backend meets them.

Imitated from the 1.2 code as this project read it before (shared/orpheus-facts.md, "Found by reading upstream
sources"), names re-checked where the code index holds a version (sampling_params.py at 000a01de):
  * `llmapi/llm_args.py` `SamplerType` {TRTLLMSampler, TorchSampler, auto} and `TorchLlmArgs.sampler_type`: "auto,
    which will use TorchSampler unless BeamSearch is requested"; an unknown name raises.
  * `_torch/pyexecutor/sampler.py` TorchSampler: no repetition/presence/frequency penalty (they came with
    NVIDIA/TensorRT-LLM#16485, after 1.2); one generator for every request (`TorchSampler.get_generator`), so a seed
    does nothing; `_apply_embedding_bias` stacks the unique (by identity) bias rows of the batch into a pinned host
    tensor and copies it to the GPU every step.
  * TRTLLMSampler (`GptDecoderBatched`, the C++ decoder): penalty kernels (`batchApplyPenalty`) over prompt and
    output, one curand state per request seeded by its seed, and the bias copied once into the request's decoder
    slot at admission (`batch_manager/createNewDecoderRequests.cpp` `CreateNewDecoderRequests::newRequest`).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .api import LLM, Request, Sampler, draw, repetition_penalty


class SamplerType(str, enum.Enum):
    """tensorrt_llm/llmapi/llm_args.py SamplerType in 1.2."""

    TRTLLMSampler = "TRTLLMSampler"
    TorchSampler = "TorchSampler"
    auto = "auto"


def stacked_bias_bytes(active: list[Request]) -> int:
    """TorchSampler._apply_embedding_bias: the unique bias tensors (by identity) stacked and uploaded this step."""
    unique = {id(r.bias): r.bias for r in active if r.bias is not None}
    return sum(b.numel() * b.element_size() for b in unique.values())


def stack_biases(active: list[Request], rows: int) -> tuple[torch.Tensor | None, torch.Tensor, list[int]]:
    """The host side of `_apply_embedding_bias` (also what cost.py times): row mask, stacked biases, gather indices."""
    mask = torch.zeros((rows,), dtype=torch.bool)
    index: dict[int, int] = {}
    unique: list[torch.Tensor] = []
    gather: list[int] = []
    for i, r in enumerate(active):
        if r.bias is None:
            continue
        mask[i] = True
        if id(r.bias) not in index:
            index[id(r.bias)] = len(unique)
            unique.append(r.bias)
        gather.append(index[id(r.bias)])
    if not unique:
        return None, mask, gather
    return torch.stack(unique), mask, gather


class TorchSampler12(Sampler):
    """1.2's TorchSampler: the bias stacked per step, no penalties, one shared generator."""

    name = "TorchSampler"

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def host_bias_bytes(self, active: list[Request]) -> int:
        return stacked_bias_bytes(active)

    def add_bias(self, active: list[Request], logits: torch.Tensor) -> None:
        stacked, mask, gather = stack_biases(active, logits.shape[0])
        if stacked is not None:
            logits[mask] += stacked[torch.tensor(gather)]

    def penalize(self, r: Request, row: torch.Tensor) -> None:
        """No occurrence penalties in 1.2's TorchSampler."""

    def row_generators(self, active: list[Request]) -> list[torch.Generator]:
        """TorchSampler.get_generator: one generator, whatever the requests' seeds."""
        return [self.generator] * len(active)

    def sample(self, active: list[Request], logits: torch.Tensor) -> list[int]:
        self.add_bias(active, logits)
        out = []
        for i, (r, gen) in enumerate(zip(active, self.row_generators(active), strict=True)):
            self.penalize(r, logits[i])
            out.append(draw(logits[i], r.params.temperature, gen))
        return out


class TrtllmSampler(Sampler):
    """The C++ decoder: bias in the slot once, penalties over prompt + output, a curand state per request."""

    name = "TRTLLMSampler"

    def __init__(self) -> None:
        self.bias_uploads = 0
        self.generators: dict[int, torch.Generator] = {}

    def admit(self, r: Request) -> None:
        if r.bias is not None:
            self.bias_uploads += 1
        seed = r.params.seed if r.params.seed is not None else 0
        self.generators[r.request_id] = torch.Generator().manual_seed(seed)

    def sample(self, active: list[Request], logits: torch.Tensor) -> list[int]:
        out = []
        for i, r in enumerate(active):
            row = logits[i]
            if r.bias is not None:
                row += r.bias
            repetition_penalty(row, r.prompt + r.generated, r.params.repetition_penalty)
            out.append(draw(row, r.params.temperature, self.generators[r.request_id]))
        return out


class LLM12(LLM):
    """The 1.2 LLM: `sampler_type` is an enum field; "auto" picks TorchSampler."""

    version = "1.2.1"

    def validate(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        self.requested = SamplerType(kwargs.pop("sampler_type", "auto")).value  # an unknown name raises
        return kwargs

    def make_sampler(self, kwargs: dict[str, Any]) -> Sampler:
        return TrtllmSampler() if self.requested == "TRTLLMSampler" else TorchSampler12()
