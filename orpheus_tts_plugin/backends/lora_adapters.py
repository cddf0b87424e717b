"""LoRA adapter folders as every backend that serves them reads them: a folder, a stable id, a rank, its config.

`EngineConfig.adapters` names PEFT folders (or hub ids); each is read once at start: its adapter_config.json must be
a PEFT LoRA (`peft_type` "LORA", an int `r` >= 1) next to its weights. A missing or invalid one is refused in one
line, before the engine loads. Ids are 1, 2, ... in name order (the config keeps the pairs sorted), the same for the
life of the backend: both engines key their loaded adapters by id (0 is "no adapter" to both).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import BackendError, GenerationRequest

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its name (EngineConfig.adapters), its engine id (>= 1), its local folder and rank."""

    name: str
    int_id: int
    path: str
    rank: int
    config: dict[str, Any] = field(default_factory=dict, compare=False)  # its adapter_config.json


def local_folder(name: str, source: str, *, download: bool = True) -> Path:
    """The adapter's local folder: `source` itself, or a hub id's snapshot (Hugging Face cache, HF_HUB_OFFLINE)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve()
    if download and not path.exists() and source.count("/") == 1 and not source.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(source, allow_patterns=["adapter_config.json", "adapter_model.*"]))
        except Exception as exc:  # offline, no such repo, no access: one line below
            raise ValueError(f"LoRA adapter {name!r}: {source} is no folder and no hub download ({exc})") from exc
    raise ValueError(f"LoRA adapter {name!r}: {source} is not a folder")


def read_adapter(name: str, source: str, int_id: int, *, download: bool = True) -> LoraAdapter:
    """The adapter `name` at `source` (a PEFT LoRA folder or hub id); ValueError in one line if it is not one."""
    folder = local_folder(name, source, download=download)
    config_path = folder / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json (not a PEFT folder)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not a LoRA (peft_type {kind!r}, not 'LORA')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: {config_path} has no rank (r: {rank!r}, not an int >= 1)")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    return LoraAdapter(name, int_id, str(folder), rank, config)


def read_adapters(adapters: Sequence[tuple[str, str]], *, download: bool = True) -> dict[str, LoraAdapter]:
    """Every adapter of `EngineConfig.adapters` by name, ids 1, 2, ... in name order."""
    pairs = sorted(adapters)
    return {name: read_adapter(name, source, i, download=download) for i, (name, source) in enumerate(pairs, 1)}


def adapter_of(adapters: dict[str, LoraAdapter], req: GenerationRequest, backend: str) -> LoraAdapter | None:
    """The adapter of `req` (None: the base model); BackendError for a name the backend was not started with."""
    if req.adapter is None:
        return None
    found = adapters.get(req.adapter)
    if found is None:
        known = ", ".join(adapters) or "none"
        raise BackendError(f"{backend}: unknown LoRA adapter {req.adapter!r} (this backend serves: {known})")
    return found
