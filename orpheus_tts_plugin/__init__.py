"""Orpheus TTS inside a voice agent's process: one shared engine, exact streaming, framework adapters."""

from __future__ import annotations

from typing import Any

from .config import EngineConfig, SamplingOverrides, SamplingParams, SyntheticConfig
from .engine import AudioChunk, OrpheusEngine
from .errors import EngineClosedError, EngineError, EngineFailedError, EngineOverloadedError, ModelLoadError

__all__ = [
    "AudioChunk",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineFailedError",
    "EngineOverloadedError",
    "ModelLoadError",
    "OrpheusEngine",
    "OrpheusTTSService",
    "SamplingOverrides",
    "SamplingParams",
    "SyntheticConfig",
]


def __getattr__(name: str) -> Any:
    """Framework adapters load on first use, so importing the package never imports Pipecat."""
    if name == "OrpheusTTSService":
        from .pipecat import OrpheusTTSService

        return OrpheusTTSService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
