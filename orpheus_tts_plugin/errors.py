"""The engine's typed errors: what a caller (and each framework adapter) tells apart."""

from __future__ import annotations


class EngineError(RuntimeError):
    """A stream failed inside the engine (backend error, decoder error, engine closed)."""


class EngineClosedError(EngineError):
    """The engine was closed (before or while this stream ran); retrying on it cannot help."""


class EngineOverloadedError(EngineError):
    """The engine is full (`max_streams`, or queued too long behind a full batch); retry later or elsewhere."""


class EngineFailedError(EngineError):
    """An engine thread died; the engine serves nothing more (`health()` says why)."""


class ModelLoadError(EngineError):
    """Weights, tokenizer or SNAC could not be loaded; the message says what is missing and how to get it."""


class DeviceUnavailableError(ModelLoadError):
    """The device asked for is not one this torch can run on (CUDA on a CPU build, a missing GPU); the message
    says which to use."""


def missing_extra(extra: str, what: str, exc: ImportError) -> ImportError:
    """One-line ImportError for an optional dependency that is not installed, saying how to install it."""
    return ImportError(f"{what} needs the {extra!r} extra: pip install 'orpheus-tts-plugin[{extra}]' ({exc})")
