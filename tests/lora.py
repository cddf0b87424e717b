"""Random PEFT LoRA adapters of the test model, and the checkpoint with one merged into its weights.

For tests of the backends that serve adapters (tests_vllm imports it too): an adapter request must make the same
tokens as its merged checkpoint. The adapter folder is what PEFT's `save_pretrained` writes for a LoRA of a Llama:
adapter_config.json and adapter_model.safetensors with `base_model.model.<module>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r); B is non-zero (PEFT initialises it to zero, which would make the adapter a no-op).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _module_key(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{_MODULES.get(target, 'mlp')}.{target}"


def write_lora_adapter(
    model_dir: str | Path,
    out: str | Path,
    *,
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
    targets: tuple[str, ...] = TARGETS,
    scale: float = 1.0,
) -> Path:
    """A random PEFT LoRA adapter of the checkpoint in `model_dir`, written to `out` (returned).

    `scale` multiplies B (std 0.2 · scale; A's is 1 / sqrt(in)).
    """
    from safetensors.torch import load_file, save_file

    model_dir, out = Path(model_dir), Path(out)
    base = load_file(model_dir / "model.safetensors")
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            key = _module_key(layer, target)
            n_out, n_in = base[f"{key}.weight"].shape
            a = torch.randn(r, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, r, generator=gen) * 0.2 * scale
            tensors[f"base_model.model.{key}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{key}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def merge_lora_adapter(model_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """`model_dir` with the adapter merged into its weights (W + lora_alpha / r · B @ A, in fp32), written to `out`."""
    from safetensors.torch import load_file, save_file

    model_dir, adapter_dir, out = Path(model_dir), Path(adapter_dir), Path(out)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    lora = load_file(adapter_dir / "adapter_model.safetensors")
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    weights = load_file(model_dir / "model.safetensors")
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    for name, a in lora.items():
        if name.endswith(suffix):
            key = name[len(prefix) : -len(suffix)]
            b = lora[f"{prefix}{key}.lora_B.weight"]
            w = weights[f"{key}.weight"]
            weights[f"{key}.weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
