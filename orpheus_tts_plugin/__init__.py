"""Orpheus TTS inside a voice agent's process: one shared engine, exact streaming, framework adapters.

The folders in data-flow order: `speech` (text → requests) → `backends` (token ids) → `codec` (frames → PCM) →
`engine` (on `runtime`) → `pipecat`, `livekit`, `server` and `client` (over `wire`); `tools` is the workshop.
The modules at the top (config, errors, types, spec, weights, speculation, preflight, interrupt, cli) are the
"root" that each folder's `May import:` line names.
"""

from __future__ import annotations

from typing import Any

# The one place the version is written: pyproject.toml reads it (dynamic), `orpheus-tts --version` prints it.
__version__ = "0.1.0"

from .config import EngineConfig, SamplingOverrides, SamplingParams, SyntheticConfig
from .engine.core import OrpheusEngine
from .errors import (
    EngineClosedError,
    EngineError,
    EngineFailedError,
    EngineOverloadedError,
    KeyRefusedError,
    ModelLoadError,
)
from .types import AudioChunk, Speech, SpeechEngine, SpeechOptions, Usage

__all__ = [
    "AudioChunk",
    "EngineClosedError",
    "EngineConfig",
    "EngineError",
    "EngineFailedError",
    "EngineOverloadedError",
    "KeyRefusedError",
    "ModelLoadError",
    "OrpheusEngine",
    "OrpheusTTSService",
    "RemoteEngine",
    "SamplingOverrides",
    "SamplingParams",
    "Speech",
    "SpeechEngine",
    "SpeechOptions",
    "SyntheticConfig",
    "Usage",
]


def __getattr__(name: str) -> Any:
    """Framework adapters and RemoteEngine load on first use: importing the package imports no Pipecat or websockets."""
    if name == "OrpheusTTSService":
        from .pipecat.tts import OrpheusTTSService

        return OrpheusTTSService
    if name == "RemoteEngine":
        from .client.remote_engine import RemoteEngine

        return RemoteEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
