"""The engine's typed errors: what a caller (and each framework adapter) tells apart."""

from __future__ import annotations

import enum


class EngineError(RuntimeError):
    """A stream failed inside the engine (backend error, decoder error, engine closed)."""


class EngineClosedError(EngineError):
    """The engine was closed (before or while this stream ran); retrying on it cannot help."""


class EngineOverloadedError(EngineError):
    """The engine is full (`max_streams`, or queued too long behind a full batch); retry later or elsewhere."""


class EngineFailedError(EngineError):
    """An engine thread died; the engine serves nothing more (`health()` says why)."""


class KeyRefusedError(EngineError):
    """A server refused this client's API key (none given, or one it does not hold); retrying cannot help."""


class ModelLoadError(EngineError):
    """Weights, tokenizer or SNAC could not be loaded; the message says what is missing and how to get it."""


class DeviceUnavailableError(ModelLoadError):
    """The device asked for is not one this torch can run on (CUDA on a CPU build, a missing GPU); the message
    says which to use."""


class Failure(enum.Enum):
    """What a failed request means to a caller, whatever its framework: each adapter maps these to its own errors."""

    TIMEOUT = "no audio in time"  # a stall or a slow engine: another try may well succeed
    OVERLOADED = "engine overloaded"  # full now: later, or another engine
    ENGINE_FAILED = "engine failed"  # an engine thread died: it serves nothing more
    LOAD_FAILED = "engine failed to load"
    CLOSED = "engine closed"
    BAD_INPUT = "bad text, voice or sampling value"  # retrying cannot help
    STREAM_FAILED = "stream failed"  # one generation failed (backend or decoder fault); the engine still serves
    ENGINE_DOWN = "engine not serving"  # any other failure of an engine that is failed or closed
    UNEXPECTED = "unexpected error"  # not an engine error, from an engine that still serves: a bug or a broken set-up


_FAILURES: tuple[tuple[type[BaseException], Failure], ...] = (  # first match wins
    (TimeoutError, Failure.TIMEOUT),
    (EngineOverloadedError, Failure.OVERLOADED),
    (EngineFailedError, Failure.ENGINE_FAILED),
    (ModelLoadError, Failure.LOAD_FAILED),
    (EngineClosedError, Failure.CLOSED),
    (ValueError, Failure.BAD_INPUT),
    (TypeError, Failure.BAD_INPUT),
)


def failure_of(exc: BaseException, *, serving: bool) -> Failure:
    """What `exc` means; `serving`: the engine is neither failed nor closed (`health()`), so it may serve again."""
    kind = next((kind for cls, kind in _FAILURES if isinstance(exc, cls)), None)
    if kind is not None:
        return kind
    if not serving:
        return Failure.ENGINE_DOWN
    return Failure.STREAM_FAILED if isinstance(exc, EngineError) else Failure.UNEXPECTED


def missing_extra(extra: str, what: str, exc: ImportError) -> ImportError:
    """One-line ImportError for an optional dependency that is not installed, saying how to install it."""
    return ImportError(f"{what} needs the {extra!r} extra: pip install 'orpheus-tts-plugin[{extra}]' ({exc})")
