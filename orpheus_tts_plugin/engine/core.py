"""The process-wide Orpheus engine: text in, 24 kHz PCM out, for callers on any loop in any thread.

Threads: the engine runs its own event loop in one thread (`LoopThread`; it drives the backend's token
streams and parses frames), decoding runs in the decoder thread (`decode_worker`), and audio reaches each
caller's event loop through one `call_soon_threadsafe` per loop per decoder tick. So one engine serves
callers on any number of event loops in any number of threads at once.

Failure model: a fault ends only the streams it concerns, each with an `EngineError` within one tick;
if an engine thread dies anyway, the engine marks itself failed and every open and new stream gets an
`EngineFailedError` at once. Nothing waits without bound: a request's first token must come within
`queue_timeout_s`, else `EngineOverloadedError`.

`OrpheusEngine` is what callers hold: `synthesize` and the caller's side of each stream live here; the roles it
is made of live beside it (`lifecycle`, `voices`, `admission`, `generation`, `stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ..backends.protocol import TokenBackend
from ..config import EngineConfig, SamplingOverrides, check_text_length
from ..runtime.loop_thread import SharedInstances
from ..speculation import Speculation, SpeculationTally
from ..speech.prompt import sentence_requests
from ..speech.stretch import stretched
from ..speech.text import split_sentences
from ..types import AudioChunk, Speech, SpeechEngine, SpeechOptions, Usage
from .admission import Admission
from .decode_worker import CallerStream
from .generation import Generation
from .lifecycle import Lifecycle
from .stats import Counters
from .voices import EngineVoices

if TYPE_CHECKING:
    from ..codec.decoder import FrameDecoder

__all__ = ["AudioChunk", "OrpheusEngine", "SpeechEngine"]  # AudioChunk and SpeechEngine: their first home

# What a text over EngineConfig.max_text_chars should do instead (the ValueError's tail).
TEXT_REMEDY = " (EngineConfig.max_text_chars; None lifts it): pass it a sentence or a paragraph at a time"


class OrpheusEngine(Lifecycle, EngineVoices, Admission, Generation):
    """Text in, 24 kHz PCM out, for every caller in the process (see `synthesize`)."""

    _shared: SharedInstances[EngineConfig, OrpheusEngine] = SharedInstances(lambda engine: engine._closed)

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        backend: TokenBackend | None = None,
        decoder: FrameDecoder | None = None,
    ):
        """An engine of `config`; `backend` and `decoder` replace the ones the config names (tests, benchmarks)."""
        self.config = config or EngineConfig()
        self._lock = threading.Lock()  # guards _open (admission), _closed, _failure, _started (lifecycle)
        self._counters = Counters()  # any thread (its own lock)
        self._speculations = SpeculationTally()  # any thread (its own lock)
        self._init_voices()
        self._init_lifecycle(backend, decoder)
        self._init_admission()
        self._init_generation()

    @classmethod
    def shared(cls, config: EngineConfig | None = None) -> OrpheusEngine:
        """The process-wide engine for `config` (created on first use, started by the first caller)."""
        config = config or EngineConfig()
        return cls._shared.get(config, lambda: cls(config))

    def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        options: SpeechOptions | None = None,
        adapter: str | None = None,
        token_log: list[int] | None = None,
        speculative: bool = False,
        usage: Usage | None = None,
        **overrides: float | int | None,
    ) -> Speech:
        """Speak `text`: a `Speech`, an async iterator of AudioChunk (the last with `final=True`) and its sentences.

        `adapter`: a LoRA adapter of `EngineConfig.adapters` (a voice of `adapter_voices` picks its own).
        Sampling: `sampling` and/or keyword overrides (temperature, top_p, repetition_penalty, max_tokens, seed),
        and `speed` (0.25 to 4.0: the audio stretched, pitch kept, `stretch.py`); None takes the engine's default.
        Or `options`, as `check_options` returned them (not checked again).
        Sentence i of a long text is generated with seed + i, so, run alone, it equals that sentence spoken alone
        with seed + i; beside other streams a seed fixes the tokens only with the hf backend's `batch_invariant`
        steps (otherwise the batch's rounding can flip a nearly tied one: docs/engine.md, "Seeds"). Validates
        eagerly (TypeError/ValueError naming the field; text over `EngineConfig.max_text_chars`, ValueError naming
        the limit). Empty text yields nothing. Long text is split at sentence bounds and spoken in order, each
        sentence's audio whole before the next. Leaving the loop early, `aclose()`
        or cancelling the task aborts the generation within one engine step. `token_log`, if given, receives every
        generated id, each utterance closed by the end-of-speech id: what `orpheus-tts decode` replays.
        `speculative`: a reply spoken before the caller's turn is confirmed; `Speech.confirm()` once it will be
        played, else it counts as discarded (`stats()`: `speculative_*`). It is generated like any other. The
        Speech's `usage` counts its prompt and generated ids (into `usage`, if given: what a server's route reads
        after).
        """
        check_text_length(text, self.config.max_text_chars, "the engine's", remedy=TEXT_REMEDY)
        if not isinstance(speculative, bool):
            raise TypeError(f"speculative must be a bool, got {type(speculative).__name__}")
        options = SpeechOptions.chosen(options, self.check_options, voice, sampling, adapter, **overrides)
        pieces = self.sentences(text)
        speculation = self._speculations.open() if speculative else None
        usage = Usage() if usage is None else usage
        chunks = self._synthesize(pieces, options, token_log, speculation, usage)
        if options.speed != 1.0:  # after decoding, on the caller's loop (a tenth of a ms a chunk: stretch.py)
            chunks = stretched(chunks, options.speed)
        return Speech(pieces, chunks, speculation, usage)

    def sentences(self, text: str) -> list[str]:
        """The sentences `synthesize(text)` speaks, one request each, in order (`AudioChunk.utterance` indexes them)."""
        return split_sentences(text, self.config.sentence_max_chars)

    def check_options(
        self,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        *,
        adapter: str | None = None,
        **overrides: float | int | None,
    ) -> SpeechOptions:
        """The voice, LoRA adapter and sampling a request would use (unpacks as `(voice, sampling)`);
        TypeError/ValueError naming what is wrong.

        Adapters call this when options change, so that bad input fails there and then rather than in
        the middle of a call, and pass the result to `synthesize(options=...)`.
        """
        cfg = self.config
        return SpeechOptions.check(
            self.spec, cfg.sampling, voice, sampling, adapter, cfg.adapter_names, dict(cfg.adapter_voices), **overrides
        )

    async def _synthesize(
        self,
        pieces: list[str],
        options: SpeechOptions,
        token_log: list[int] | None,
        speculation: Speculation | None,
        usage: Usage,
    ) -> AsyncGenerator[AudioChunk, None]:
        if not pieces:
            return
        await self.start()
        stream = CallerStream(asyncio.get_running_loop(), speculation, usage)
        reference = self._reference(options.voice)
        requests = sentence_requests(
            stream.id, pieces, options, self._tokenizer, self.spec, self.config, reference=reference
        )
        usage.input_tokens = sum(len(req.prompt_ids) for req, _ in requests)
        self._admit(stream)
        if speculation is not None:
            speculation.started()
        self._loop.call_soon_threadsafe(self._begin, stream, requests, token_log)
        complete = False
        try:
            while not complete:
                chunk = await stream.box.get()
                complete = chunk.final
                self._taken(stream, chunk.num_samples)
                yield chunk
        finally:
            if not complete:
                stream.closed = True
                self._release(stream)  # the caller has left: its place is free now, its abort follows in a step
                self._counters.count("streams_failed" if stream.box.ended else "streams_cancelled")
                if speculation is not None:  # ended before its end, unconfirmed: its audio will not be played
                    speculation.discard()
                with contextlib.suppress(RuntimeError):  # RuntimeError: the engine loop is already closed
                    self._loop.call_soon_threadsafe(self._cancel, stream)

    def stats(self) -> dict[str, Any]:
        """Counters of the whole engine: active_streams, tokens, frames, finish reasons, bad ids, decoder calls, and
        speculative streams (`speculation.STAT_KEYS`: started, confirmed, discarded, and the discarded ones' audio
        seconds generated and stream-seconds held)."""
        health = self.health()
        with self._lock:
            out: dict[str, Any] = {"active_streams": len(self._open), **self._counters.snapshot()}
        out.update(self._speculations.stats())
        out["status"], out["failure"] = health["status"], health["reason"] if health["status"] == "failed" else None
        if self._worker is not None:
            out.update(self._worker.decoder.stats())
            out["decoder_ticks"] = self._worker.ticks
        if self._backend is not None:
            out["backend"] = self._backend.stats()
        return out
