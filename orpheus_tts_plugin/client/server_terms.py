"""What a RemoteEngine's servers accept of a request, as their hellos and statuses said: the voices (cloned ones come
and go), sampling defaults, LoRA adapters and text limits that a request is checked against locally."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..config import MAX_TEXT_CHARS, EngineConfig, SamplingParams
from ..spec import SPECS, ModelSpec, spec_for
from ..wire import protocol


class ServerTerms:
    """Until a server's hello, the model family's voices and the local defaults; then the servers' own.

    The connection's loop writes, replacing each attribute whole; other threads read.
    """

    def __init__(self, model_family: str):
        # Replaced at each hello and each status that lists voices.
        self.spec: ModelSpec = spec_for(model_family)
        self.sampling = SamplingParams()  # the server's defaults, replaced at each hello
        self.adapters: tuple[str, ...] = ()  # the server's LoRA adapters, replaced at each hello
        self.sentence_max_chars = EngineConfig().sentence_max_chars  # the server's, replaced at each hello
        self.max_chars = MAX_TEXT_CHARS  # characters a request may have: the server's, replaced at each hello

    def adopt(self, hello: protocol.Hello, listed: Sequence[Sequence[str]]) -> None:
        """A new connection's hello: its voices, sampling defaults, adapters and limits; then `listed` as
        `take_voices`."""
        base = SPECS.get(hello.model_family) or ModelSpec(name=hello.model_family)
        self.spec = replace(base, voices=hello.voices, default_voice=hello.default_voice)
        self.sampling = hello.sampling
        self.adapters = hello.adapters
        self.sentence_max_chars = hello.sentence_max_chars
        self.max_chars = hello.max_chars
        self.take_voices(listed)

    def take_voices(self, listed: Sequence[Sequence[str]]) -> None:
        """The voices the connected servers' latest `status` listed (cloned voices added since the hello; polled
        from behind a proxy), all of them in the order listed; none listed (no status names voices): no change."""
        if not listed:
            return
        voices = tuple(dict.fromkeys(voice for voices in listed for voice in voices))
        if voices != self.spec.voices:
            self.spec = replace(self.spec, voices=voices)
