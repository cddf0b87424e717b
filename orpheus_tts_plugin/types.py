"""What callers of an engine see: audio chunks, checked options, a speech stream, and the engine's interface.

Used alike by `OrpheusEngine` (in process), `RemoteEngine` (over a socket), the framework adapters and
the server, so it imports nothing of them.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .config import SamplingOverrides, SamplingParams, check_speed
from .spec import SAMPLE_RATE, ModelSpec
from .speculation import Speculation


@dataclass(frozen=True)
class AudioChunk:
    """A piece of one stream's audio: int16 little-endian mono PCM.

    `utterance` is the index of the sentence it belongs to (in `Speech.sentences`); `utterance_end` marks
    that sentence's last chunk, `final` the stream's.
    """

    pcm: bytes
    start_sample: int
    final: bool
    sample_rate: int = SAMPLE_RATE
    utterance: int = 0
    utterance_end: bool = False

    @property
    def num_samples(self) -> int:
        return len(self.pcm) // 2


@dataclass(frozen=True)
class SpeechOptions:
    """A request's voice and sampling as an engine checked them (`check_options`): kept and passed as they are.

    `sampling` is complete (the engine's defaults filled in); `overrides` is what the caller set, which is what
    travels to a server (it fills in its own defaults). Reads as the `(voice, sampling)` pair that
    `check_options` returned before it returned this. A `sampling.seed` reproduces the request's tokens when it runs
    alone; beside other streams only with the hf backend's `batch_invariant` steps (docs/engine.md, "Seeds").
    """

    voice: str | None
    sampling: SamplingParams
    overrides: SamplingOverrides = SamplingOverrides()
    adapter: str | None = None  # the LoRA adapter that speaks (given, or the one the voice maps to); None: none
    speed: float = 1.0  # the audio's tempo (config.SPEED_RANGE), stretched after decoding with its pitch kept

    def __iter__(self) -> Iterator[Any]:
        return iter((self.voice, self.sampling))

    def __getitem__(self, index: int) -> Any:
        return (self.voice, self.sampling)[index]

    def __len__(self) -> int:
        return 2

    @classmethod
    def check(
        cls,
        spec: ModelSpec,
        defaults: SamplingParams,
        voice: str | None,
        sampling: SamplingOverrides | None,
        adapter: str | None = None,
        adapters: Collection[str] = (),
        voice_adapters: Mapping[str, str] | None = None,
        speed: float | None = None,
        **changes: Any,
    ) -> SpeechOptions:
        """`voice` and the sampling overrides checked against `spec` and applied to `defaults`, `adapter` against
        `adapters` (None: the adapter `voice_adapters` maps the voice to, if any), and `speed` (None: 1.0) against
        config.SPEED_RANGE; TypeError/ValueError."""
        overrides = SamplingOverrides.of(sampling, **changes)
        checked_speed = 1.0 if speed is None else check_speed(speed)
        voice = spec.check_voice(voice)
        if adapter is None:
            adapter = (voice_adapters or {}).get(voice or "")
        elif not isinstance(adapter, str):
            raise TypeError(f"adapter must be a str, got {type(adapter).__name__} {adapter!r}")
        elif adapter not in adapters:
            known = ", ".join(adapters) or "none (EngineConfig.adapters)"
            raise ValueError(f"unknown adapter {adapter!r}; this engine's adapters: {known}")
        return cls(voice, overrides.apply(defaults), overrides, adapter, checked_speed)

    @staticmethod
    def chosen(
        given: SpeechOptions | None,
        check: Callable[..., SpeechOptions],
        voice: str | None,
        sampling: Any,
        adapter: str | None = None,
        **changes: Any,
    ) -> SpeechOptions:
        """A synthesize call's options: `given` as it is (checked before), else `check(voice, sampling, adapter=adapter,
        **changes)`."""
        if given is None:
            return check(voice, sampling, adapter=adapter, **changes)
        if not isinstance(given, SpeechOptions):
            raise TypeError(f"options must be SpeechOptions (from check_options), got {type(given).__name__}")
        if voice is not None or sampling is not None or adapter is not None or changes:
            raise TypeError("pass either options or voice/adapter/sampling values, not both")
        return given


@dataclass
class Usage:
    """The tokens of one stream, as OpenAI's `usage` counts them: `input_tokens` the ids of its prompts (one a
    sentence, a cloned voice's reference turn included), `output_tokens` the ids generated for it (each sentence's
    end-of-speech id included). Written by the engine's loop as the stream goes; whole once its last chunk is out."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_dict(self) -> dict[str, int]:
        """OpenAI's `usage` object."""
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.total_tokens,
        }


class Speech:
    """One `synthesize` call: an async iterator of its AudioChunks that knows the sentences it speaks.

    `sentences[i]` is the text of the chunks whose `utterance` is i, split once, by the engine that speaks
    them. `usage` counts its tokens (None where the engine cannot: a RemoteEngine's server keeps them).
    Iterate it, or leave early with `aclose()` (which aborts the generation within one engine step).
    Like the async generator it replaced, it takes weak references (`__weakref__`).

    A speculative one (`synthesize(..., speculative=True)`: a reply spoken while the caller's turn is still being
    confirmed) is settled once: `confirm()` when its audio will be played, while it generates or after; closed,
    cancelled, left early or garbage-collected before that, it counts as discarded (the engine's `stats()`).
    """

    __slots__ = ("_chunks", "_on_drop", "_speculation", "sentences", "usage", "__weakref__")

    def __init__(
        self,
        sentences: Sequence[str],
        chunks: AsyncGenerator[AudioChunk, None],
        speculation: Speculation | None = None,
        usage: Usage | None = None,
    ):
        self.sentences: tuple[str, ...] = tuple(sentences)
        self.usage = usage
        self._chunks = chunks
        self._speculation = speculation
        # Dropped unsettled, it was discarded; the finalizer only queues that (no lock taken in a collection).
        self._on_drop = None if speculation is None else weakref.finalize(self, speculation.dropped)

    @property
    def speculative(self) -> bool:
        return self._speculation is not None

    def confirm(self) -> None:
        """The speculation is confirmed: its audio will be played. Idempotent; a no-op for a non-speculative
        Speech or one already discarded."""
        if self._speculation is not None:
            self._speculation.confirm()
            self._on_drop.detach()

    def take_speculation(self) -> Speculation | None:
        """Hand the settling of its speculation to the caller (a server, until its client confirms or discards):
        closing or dropping this Speech after it no longer discards it; ending early still does."""
        if self._on_drop is not None:
            self._on_drop.detach()
        speculation, self._speculation = self._speculation, None
        return speculation

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self

    async def __anext__(self) -> AudioChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            if self._speculation is not None:
                self._speculation.discard()
                self._on_drop.detach()

    async def athrow(self, *args: Any) -> AudioChunk:
        return await self._chunks.athrow(*args)

    async def asend(self, value: None) -> AudioChunk:
        return await self._chunks.asend(value)


class SpeechEngine(Protocol):
    """What the framework adapters use of an engine: `OrpheusEngine` in process, `RemoteEngine` over a socket."""

    config: Any  # .model and .backend name what it runs

    @property
    def spec(self) -> ModelSpec:
        """The model family's token ids and voices (read-only: `RemoteEngine` learns it from its servers)."""
        ...

    def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        options: SpeechOptions | None = None,
        adapter: str | None = None,
        speculative: bool = False,
        **overrides: Any,
    ) -> Speech: ...

    def check_options(
        self,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        *,
        adapter: str | None = None,
        **overrides: Any,
    ) -> SpeechOptions: ...

    def sentences(self, text: str) -> list[str]: ...

    async def start(self) -> None: ...

    def prewarm(self) -> None: ...

    @property
    def started(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    def health(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    @property
    def load(self) -> float: ...

    async def aclose(self) -> None: ...
