"""The token backend protocol and the types every backend shares: a request, finish reasons, the error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..config import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt token ids in, audio token ids out, at most `max_new_tokens`."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    constrain_audio: bool = True
    priority: bool = False  # a continuation of a stream that is already speaking: served before new requests
    # The leading ids of `prompt_ids` that other requests share (a cloned voice's reference turn): a backend may
    # compute their KV once and reuse it (hf: its prefix store; vLLM, TensorRT-LLM: their own prefix caching).
    prefix_len: int = 0
    adapter: str | None = None  # the LoRA adapter (EngineConfig.adapters) that generates it; None: the base model


class FinishReason:
    """Why a generation ended."""

    STOP = "stop"  # the model emitted the end-of-speech id
    LENGTH = "length"  # max_new_tokens reached
    ABORTED = "aborted"  # the consumer closed the stream
    ERROR = "error"


@runtime_checkable
class TokenStream(Protocol):
    """New token ids of one request, as the backend produces them."""

    finish_reason: str | None

    def __aiter__(self) -> AsyncIterator[Sequence[int]]: ...

    async def __anext__(self) -> Sequence[int]: ...

    async def aclose(self) -> None:
        """Abort the request in the backend within one engine step."""


@runtime_checkable
class PausableStream(Protocol):
    """A TokenStream whose generation can stop while its consumer is behind, and go on where it stopped."""

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) generating: a stepped row keeps its KV cache, a pumped request is redone."""


@runtime_checkable
class TokenBackend(Protocol):
    """Token generation behind one small protocol; knows nothing about audio."""

    async def start(self) -> None: ...

    def generate(self, req: GenerationRequest) -> TokenStream: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class BackendError(RuntimeError):
    """The backend failed a request (the model crashed, the server went away)."""


def check_loop(started_on: asyncio.AbstractEventLoop | None, name: str) -> None:
    """BackendError unless the backend was started, and on the running loop (its streams live on that loop)."""
    if started_on is None:
        raise BackendError(f"{name} backend is not started")
    if asyncio.get_running_loop() is not started_on:
        raise BackendError(f"{name} backend: generate() must run on the loop that started it")
