"""TensorRT-LLM >= 1.3 (1.3.0rc26, 1.4.0rc4 and main at the snapshot): TorchSampler only, as this backend meets it.

Imitated from NVIDIA/TensorRT-LLM main (code index: seed_manager.py at 2341856e, sampler/penalties.py at 0a0ceb0c,
sampler/token_ban.py at 0a1f13c0, sampler/sampler.py at 00ddb62f) and the PRs and docs named:
  * `llmapi/llm_args.py`: `SamplerType` and the `sampler_type` field are gone (#18232); a before-validator absorbs
    `sampler_type` (#18513): "auto" and "TorchSampler" are accepted and ignored, "TRTLLMSampler" is rejected (the
    1.3.0rc26 sampling docs: "sampler_type="TRTLLMSampler" is rejected").
  * `_torch/pyexecutor/sampler/penalties.py` PenaltyHandler (#16485): repetition/presence/frequency penalties from
    per-slot occurrence counts on the device, seeded with the prompt (the C++ `batchApplyPenalty` formula).
  * `_torch/pyexecutor/sampler/seed_manager.py` _SeedManager (#17172): a Philox (seed, offset) per slot, reset when
    the slot changes hands and advanced by OFFSET_STRIDE per step; but the pinned FlashInfer reads only the first
    row's seed and offset of a grouped sampling call and separates rows by their index, "so every row of a grouped
    sampling call draws from the first row's seed". Unseeded batches keep the one shared generator.
  * `sampler/sampler_features.py` / `sampler/embedding_bias.py` apply_embedding_bias: unique biases by identity,
    stacked on the host and copied to the GPU every step; since every request's SamplingParams is pickled into the
    worker (api.py), identical biases are never one tensor there (issue #17436, fix #19041 unreleased).
  * No TensorRT engine-build flow (`tensorrt_llm/builder.py` removed, #15918): no `tensorrt_llm.builder` module.
"""

from __future__ import annotations

from typing import Any

import torch

from .api import LLM, Request, Sampler, repetition_penalty
from .line12 import LLM12, TorchSampler12


class PenaltyHandler:
    """Marker for the capability probe: `tensorrt_llm._torch.pyexecutor.sampler.penalties.PenaltyHandler`."""


class SeedManager:
    """_SeedManager as the pinned FlashInfer makes it behave: per-slot state, but the group's first row decides."""

    OFFSET_STRIDE = 32

    def __init__(self, global_seed: int = 0):
        self.global_seed = global_seed
        self.owner: dict[int, int] = {}
        self.seed: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.seeded: dict[int, bool] = {}

    def observe(self, active: list[Request]) -> bool:
        """Re-seed slots whose occupant changed; True if any row of this step carries a seed."""
        for r in active:
            if self.owner.get(r.slot) != r.request_id:
                self.owner[r.slot] = r.request_id
                self.seed[r.slot] = self.global_seed if r.params.seed is None else r.params.seed
                self.offset[r.slot] = 0
                self.seeded[r.slot] = r.params.seed is not None
        return any(self.seeded[r.slot] for r in active)

    def row_generators(self, active: list[Request]) -> list[torch.Generator]:
        """One generator per row: each strategy group draws from its first row's (seed, offset), row by row."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, r in enumerate(active):
            groups.setdefault((r.params.temperature, r.params.top_p, r.params.top_k), []).append(i)
        out: list[torch.Generator] = [torch.Generator()] * len(active)
        for rows in groups.values():
            first = active[rows[0]].slot
            for j, i in enumerate(rows):
                mixed = (self.seed[first] * 1_000_003 + self.offset[first] * 7_919 + j) % (1 << 62)
                out[i] = torch.Generator().manual_seed(mixed)
        for r in active:
            self.offset[r.slot] += self.OFFSET_STRIDE
        return out


class TorchSampler13(TorchSampler12):
    """>= 1.3 TorchSampler: 1.2's bias stacking, plus penalties and the seed manager."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds = SeedManager()

    def penalize(self, r: Request, row: torch.Tensor) -> None:
        """PenaltyHandler: device-side counts include the prompt and every sampled token (no host lag)."""
        repetition_penalty(row, r.prompt + r.generated, r.params.repetition_penalty)

    def row_generators(self, active: list[Request]) -> list[torch.Generator]:
        if not self.seeds.observe(active):
            return super().row_generators(active)
        return self.seeds.row_generators(active)


class LLM13(LLM):
    """The >= 1.3 LLM: TorchSampler whatever `sampler_type` says, and "TRTLLMSampler" refused."""

    version = "1.3.0rc26"

    def validate(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        requested = kwargs.pop("sampler_type", None)
        if requested == "TRTLLMSampler":
            raise ValueError("sampler_type='TRTLLMSampler' is no longer supported: TorchSampler is the only sampler")
        if requested not in (None, "auto", "TorchSampler"):
            raise ValueError(f"invalid sampler_type {requested!r}")
        self.ignored_sampler_type = requested
        return kwargs

    def make_sampler(self, kwargs: dict[str, Any]) -> Sampler:
        return TorchSampler13()


class LLM13rc(LLM12):
    """A 1.3 candidate between #16485 and #18232: TRTLLMSampler deprecated but selectable, TorchSampler penalising."""

    version = "1.3.0rc24"

    def make_sampler(self, kwargs: dict[str, Any]) -> Sampler:
        return super().make_sampler(kwargs) if self.requested == "TRTLLMSampler" else TorchSampler13()
