"""What the CLI checks before anything loads: the voice, the backend's framework, each folder or hub id the engine
would load, the device.

Each mistake is then one line naming the fix within seconds, where a load would meet it only after the model
(a wrong voice), deep inside a library (SNAC given the Llama folder, CUDA on a CPU build) or after the hub's retries.
"""

from __future__ import annotations

import importlib
import importlib.util

from .config import COMPLETIONS_BACKENDS, EngineConfig
from .engine.device import resolve_device
from .spec import spec_for
from .weights import require_weights, weight_sources

# Backend → the framework it imports; the backend's module (backends/<name>.py) has the INSTALL_HINT for it.
_FRAMEWORKS = {"trtllm": "tensorrt_llm", "vllm": "vllm"}


def check_before_load(config: EngineConfig, voice: str | None = None) -> None:
    """Raise, in one line, what loading `config` and speaking in `voice` would fail on, without loading anything."""
    spec_for(config.model_family).check_voice(voice)
    require_framework(config.backend)
    for what, source, kind in weight_sources(config):
        require_weights(what, source, kind)
    resolve_device(config.device)


def require_framework(backend: str) -> None:
    """ImportError saying how to install it if `backend`'s framework is not installed at all (found, not imported:
    a framework that is there but fails to import is reported when the backend loads)."""
    if backend in COMPLETIONS_BACKENDS:  # light: its module's ImportError names the extra
        importlib.import_module(f"{__package__}.backends.openai_completions")
    package = _FRAMEWORKS.get(backend)
    if package is not None and importlib.util.find_spec(package) is None:
        hint = importlib.import_module(f"{__package__}.backends.{backend}").INSTALL_HINT
        raise ImportError(f"{hint} (no module named {package!r})")
