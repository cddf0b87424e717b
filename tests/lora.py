"""The test model with a LoRA adapter merged into its weights: what an adapter request must equal, token for token.

Computed from the files (W + lora_alpha / r · B @ A, in float64, stored in the checkpoint's dtype), independently
of every backend's LoRA path; the adapters themselves come from `tools.testmodel.write_lora_adapter`. Both test
suites (tests, tests_vllm) import it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


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
            weights[f"{key}.weight"] = (w.double() + scaling * (b.double() @ a.double())).to(w.dtype).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
