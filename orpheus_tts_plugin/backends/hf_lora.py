"""The hf backend's LoRA adapters (PEFT format), served beside the base model in one batched forward.

`read_adapter(name, path)` reads a PEFT LoRA folder as every backend does (`lora_adapters.read_adapter`), then its
weights (`adapter_model.safetensors` or `.bin`), and
refuses, in one line, what this path does not compute (DoRA, LoRA biases, `modules_to_save`, `alpha_pattern`,
targets other than the decoder layers' Linears). Each module's scale is `lora_alpha / r` (`/ sqrt(r)` with
`use_rslora`), r being the module's own rank (its tensors' shape: `rank_pattern` is honoured).

`LoraSet` hooks every targeted Linear of a loaded model: for the adapters' stacked A (N*R, in) and B (out, N*R)
(each adapter's rank padded with zeros to the module's largest, B scaled), one forward over a mixed batch adds
to every row `((x @ A^T) * mask) @ B^T`, the mask (row, N) one-hot of the row's adapter (all zeros: the base
model). Two GEMMs per module for the whole batch, no per-row gather and no branch on data: the cost grows with
the number of adapters configured (N * R columns), not with which rows use them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_adapters import read_adapter as read_folder

# The Linears the hf forward calls by module (attention projections, the MLP's): the only ones a LoRA may target.
TARGETS = re.compile(r"model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)")
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter: per module, A (r, in) and B (out, r) with the module's scale folded into B."""

    name: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str) -> Adapter:
    """The adapter in the PEFT folder (or hub id) `path`; ValueError naming the adapter and what is unsupported."""
    where = f"adapter {name!r} ({path})"
    found = read_folder(name, path, 0)  # the folder, a PEFT LoRA config with a rank, weights beside it
    folder, config = Path(found.path), found.config
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "lora_bias": bool(config.get("lora_bias")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "layer_replication": bool(config.get("layer_replication")),
    }
    refused = [f"{k}={config.get(k)!r}" for k, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(f"{where}: unsupported PEFT option(s) {', '.join(refused)}; plain LoRA (and rsLoRA) only")
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora"))
    state = _state(folder, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{where}: unsupported weight {key!r}; LoRA A/B of Linear layers only")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    weights = {}
    for module, ab in sorted(pairs.items()):
        if TARGETS.fullmatch(module) is None:
            raise ValueError(f"{where}: LoRA on {module!r} is not supported; attention and MLP projections only")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not pair")
        weights[module] = (a, b * (alpha / (math.sqrt(r) if rslora else r)))
    if not weights:
        raise ValueError(f"{where}: no LoRA weights")
    return Adapter(name, weights)


def _state(folder: Path, where: str) -> dict[str, torch.Tensor]:
    if (folder / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "adapter_model.safetensors"))
    if (folder / "adapter_model.bin").is_file():
        return torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{where}: no adapter_model.safetensors (or .bin)")


class LoraSet:
    """The adapters of `adapters` hooked into `model`'s targeted Linears; `select` sets each row's adapter."""

    def __init__(self, model: torch.nn.Module, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype):
        self.names = tuple(a.name for a in adapters)
        n = len(adapters)
        # Row i of `table`: the mask of adapter index i (0: the base model, all zeros; k: one-hot at k - 1).
        self.table = torch.cat([torch.zeros(1, n), torch.eye(n)]).to(device=device, dtype=dtype)
        self.mask = self.table[:1]  # (rows, N) of the forward running now: set by `select`
        self._hooks = []
        for module_name in sorted({m for a in adapters for m in a.weights}):
            linear = model.get_submodule(module_name)
            if not isinstance(linear, torch.nn.Linear):
                raise ValueError(f"LoRA target {module_name!r} is a {type(linear).__name__}, not a Linear")
            rank = max(a.weights[module_name][0].shape[0] for a in adapters if module_name in a.weights)
            a_cat = torch.zeros(n * rank, linear.in_features)
            b_cat = torch.zeros(linear.out_features, n * rank)
            for k, adapter in enumerate(adapters):
                if module_name not in adapter.weights:
                    continue
                a, b = adapter.weights[module_name]
                if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                    raise ValueError(
                        f"adapter {adapter.name!r}: {module_name} is {linear.out_features}x{linear.in_features} in "
                        f"the model, {b.shape[0]}x{a.shape[1]} in the adapter (another base model?)"
                    )
                a_cat[k * rank : k * rank + a.shape[0]] = a
                b_cat[:, k * rank : k * rank + b.shape[1]] = b
            hook = self._hook(a_cat.to(device=device, dtype=dtype), b_cat.to(device=device, dtype=dtype), rank)
            self._hooks.append(linear.register_forward_hook(hook))

    def index(self, name: str | None) -> int:
        """The adapter index of a request: 0 for the base model, ValueError for a name not loaded."""
        if name is None:
            return 0
        try:
            return self.names.index(name) + 1
        except ValueError:
            raise ValueError(f"unknown adapter {name!r}; this backend's adapters: {', '.join(self.names)}") from None

    def select(self, rows: torch.Tensor) -> None:
        """The adapter index of each row (a device tensor) of the forward about to run."""
        self.mask = self.table[rows]

    def remove(self) -> None:
        """Unhook every Linear (the model computes the base alone again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _hook(self, a_cat: torch.Tensor, b_cat: torch.Tensor, rank: int):
        def add_lora(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x = args[0]
            lead = x.shape[:-1]  # (rows, ...)
            mask = self.mask.view(lead[0], *([1] * (len(lead) - 1)), -1, 1)
            low = torch.nn.functional.linear(x, a_cat).view(*lead, -1, rank) * mask
            return out + torch.nn.functional.linear(low.view(*lead, -1), b_cat)

        return add_lora


def load_adapters(
    model: torch.nn.Module, adapters: Sequence[tuple[str, str]], device: torch.device, dtype: torch.dtype
) -> LoraSet:
    """Read every (name, path) adapter and hook them into `model`."""
    return LoraSet(model, [read_adapter(name, path) for name, path in adapters], device, dtype)
