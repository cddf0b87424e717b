"""What a checkpoint says about itself (config.json, hf_quant_config.json), local or from the hub cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's own quantisation: `method` (e.g. "modelopt") and calibrated KV cache (e.g. "FP8"), or None."""

    method: str | None
    kv_cache: str | None


def checkpoint_json(model: str, name: str, *, download: bool = False) -> dict[str, Any] | None:
    """File `name` of a local checkpoint or a hub one (cache, or fetched if `download`); None if it has none.

    LookupError if it cannot be known: a hub id not in the cache (and not fetched), offline, or unreachable.
    """
    root = Path(model)
    if root.is_dir():
        path = root / name
        return json.loads(path.read_text()) if path.is_file() else None
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(model, name)
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    if cached is not None:  # the cache records that the repo has no such file
        return None
    if not download:
        raise LookupError(f"{model}/{name} is not in the Hugging Face cache")
    try:
        return json.loads(Path(hf_hub_download(model, name)).read_text())
    except EntryNotFoundError as exc:
        if isinstance(exc, LocalEntryNotFoundError):  # offline and not cached: unknown, not absent
            raise LookupError(f"{model}/{name} is not in the Hugging Face cache (offline)") from exc
        return None
    except Exception as exc:  # noqa: BLE001 - unreachable, gated, no such repo: unknown
        raise LookupError(f"cannot read {model}/{name}: {exc}") from exc


def checkpoint_quantization(model: str, *, download: bool = False) -> CheckpointQuantization | None:
    """The checkpoint's quantisation from config.json and hf_quant_config.json; None if they cannot be read."""
    try:
        config = checkpoint_json(model, "config.json", download=download)
    except (LookupError, OSError, ValueError):
        return None
    try:  # ModelOpt writes quantization_config into config.json too: this file only adds detail
        modelopt = checkpoint_json(model, "hf_quant_config.json", download=download)
    except (LookupError, OSError, ValueError):
        modelopt = None
    qc = (config or {}).get("quantization_config") or {}
    quant = (modelopt or {}).get("quantization") or {}
    method = qc.get("quant_method") or (((modelopt or {}).get("producer") or {}).get("name") if modelopt else None)
    kv = quant.get("kv_cache_quant_algo") or qc.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme")
    return CheckpointQuantization(method=method, kv_cache=str(kv) if kv else None)
