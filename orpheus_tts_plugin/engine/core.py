"""The process-wide Orpheus engine: admission, per-stream state, generation, cancellation.

Threads: the engine runs its own event loop in one thread (`LoopThread`; it drives the backend's token
streams and parses frames), decoding runs in the decoder thread (`decode_worker`), and audio reaches each
caller's event loop through one `call_soon_threadsafe` per loop per decoder tick. So one engine serves
callers on any number of event loops in any number of threads at once.

Failure model: a fault ends only the streams it concerns, each with an `EngineError` within one tick;
if an engine thread dies anyway, the engine marks itself failed and every open and new stream gets an
`EngineFailedError` at once. Nothing waits without bound: a request's first token must come within
`queue_timeout_s`, else `EngineOverloadedError`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends.protocol import BackendError, FinishReason, GenerationRequest, PausableStream, TokenBackend
from ..codec.codes import FrameParser
from ..config import EngineConfig, SamplingOverrides, check_text_length
from ..errors import EngineClosedError, EngineError, EngineFailedError, EngineOverloadedError
from ..runtime.loop_thread import LoopThread, SharedInstances, post
from ..spec import SAMPLE_RATE, SAMPLES_PER_FRAME, ModelSpec, spec_for, with_voices
from ..speculation import Speculation, SpeculationTally
from ..speech.prompt import sentence_requests
from ..speech.stretch import stretched
from ..speech.text import split_sentences
from ..speech.voices import Voices
from ..types import AudioChunk, Speech, SpeechEngine, SpeechOptions, Usage
from .decode_worker import CallerStream, DecodeWorker, Utterance
from .loading import load

if TYPE_CHECKING:
    import numpy as np

    from ..codec.decoder import FrameDecoder

__all__ = ["AudioChunk", "OrpheusEngine", "SpeechEngine"]  # AudioChunk and SpeechEngine: their first home

log = logging.getLogger(__name__)

# What a text over EngineConfig.max_text_chars should do instead (the ValueError's tail).
TEXT_REMEDY = " (EngineConfig.max_text_chars; None lifts it): pass it a sentence or a paragraph at a time"
# Counters stats() always has, zero until counted (the others appear when they first happen).
_STREAM_COUNTERS = ("streams_started", "streams_completed", "streams_cancelled", "streams_failed", "streams_rejected")


def _failed(fut: concurrent.futures.Future[None]) -> bool:
    """Whether a done future ended without a result (an exception, or cancelled), without raising either."""
    return fut.cancelled() or fut.exception() is not None


class OrpheusEngine:
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
        # Its voices: the family's, the fine-tuned ones (`adapter_voices`), then those added (`add_voice`).
        self.spec: ModelSpec = with_voices(spec_for(self.config.model_family), dict(self.config.adapter_voices))
        self._voices = Voices(self.spec)
        self._snac: Any = None  # the SNAC whose encoder encodes added voices (the decoder's, once started)
        self._custom_backend = backend
        self._custom_decoder = decoder
        self._lock = threading.Lock()  # guards _open, _counters, _closed, _failure, _started
        self._started: concurrent.futures.Future[None] | None = None
        self._thread: LoopThread | None = None  # the engine loop's thread of the latest start
        self._backend: TokenBackend | None = None  # engine loop only, once started
        self._worker: DecodeWorker | None = None
        self._tokenizer: Any = None
        self._open: set[CallerStream] = set()
        self._counters: collections.Counter[str] = collections.Counter(dict.fromkeys(_STREAM_COUNTERS, 0))
        self._speculations = SpeculationTally()  # any thread (its own lock)
        self._closed = False
        self._failure: str | None = None
        self._kick_pending = False  # engine loop only
        unread = self.config.pause_unread_s
        self._pause_s = math.inf if unread is None else unread  # a stream's generation pauses past this unread
        self._resume_s = 0.0 if unread is None else unread / 2  # ... and resumes once its caller is back under this

    @classmethod
    def shared(cls, config: EngineConfig | None = None) -> OrpheusEngine:
        """The process-wide engine for `config` (created on first use, started by the first caller)."""
        config = config or EngineConfig()
        return cls._shared.get(config, lambda: cls(config))

    # ---------------------------------------------------------------- lifecycle
    def prewarm(self) -> None:
        """Start loading in the background and return at once (from any thread, with or without an event loop)."""
        self._begin_start()

    def _begin_start(self) -> concurrent.futures.Future[None]:
        """The shared load's future: the one under way or done, or a new one if none began or the last failed."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if self._started is not None and self._started.done() and _failed(self._started):
                self._started = None  # a load that failed may be tried again (the files fixed, the GPU freed)
            if self._started is None:
                self._thread = LoopThread("orpheus-engine")
                self._started = self._thread.start(self._boot, self._loop_stopped)
            return self._started

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        """The engine loop of the latest start (None before the first)."""
        return None if self._thread is None else self._thread.loop

    async def start(self) -> None:
        """Load the tokenizer, backend and decoder once; safe to await from any loop, any number of times.

        Cancelling a caller (a job that ends while the engine loads, a `wait_for`, Ctrl-C) never cancels
        the shared load: it goes on for every other caller and the next `start()`.
        """
        try:
            await asyncio.shield(asyncio.wrap_future(self._begin_start()))
        except EngineError as exc:  # the same error for every caller: do not let its traceback grow with each one
            raise exc.with_traceback(None) from exc.__cause__
        health = self.health()
        if health["status"] == "failed":
            raise EngineFailedError(f"engine failed: {health['reason']}")

    @property
    def started(self) -> bool:
        started = self._started
        return started is not None and started.done() and not _failed(started)

    @property
    def ready(self) -> bool:
        """Started, not closed, not failed: new streams will be served."""
        return self.health()["status"] == "ok"

    def health(self) -> dict[str, Any]:
        """{"status": "not started" | "starting" | "ok" | "failed" | "closed", "reason": why, if not ok}."""
        with self._lock:
            closed, failure, started = self._closed, self._failure, self._started
        if failure is None and self._backend is not None:
            failure = getattr(self._backend, "failure", None)
        if closed:
            return {"status": "closed", "reason": "aclose() was called"}
        if failure is not None:
            return {"status": "failed", "reason": failure}
        if started is None:
            return {"status": "not started", "reason": "start() or prewarm() not called yet"}
        if not started.done():
            return {"status": "starting", "reason": "loading"}
        if _failed(started):
            why = "interrupted" if started.cancelled() else started.exception()
            return {"status": "failed", "reason": f"start failed: {why}"}
        return {"status": "ok", "reason": None}

    def _loop_stopped(self) -> None:
        if not self._closed:
            self._fail("the engine loop stopped")

    async def _boot(self) -> None:
        """Load everything on the engine loop (every start() caller gets a failure itself)."""
        try:
            parts = await load(self.config, self.spec, backend=self._custom_backend, decoder=self._custom_decoder)
        except BaseException as exc:
            log.debug("Orpheus engine failed to start: %s", exc)
            raise
        self._tokenizer, self._backend = parts.tokenizer, parts.backend
        self._snac = getattr(parts.decoder, "snac", None)
        await asyncio.to_thread(self._voices.encode_all, self._tokenizer, self._encoder)
        self._worker = DecodeWorker(
            parts.decoder, self._stream_done, self._stream_failed, self._decoder_died, self.config.decode_ahead_s
        )

    async def aclose(self) -> None:
        """Stop every stream, the backend and the threads. The engine cannot be restarted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        if started is None:
            return
        try:
            await asyncio.shield(asyncio.wrap_future(started))
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - a failed start leaves nothing to stop
            return
        await self._thread.stop(self._shutdown)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._backend.close()
        await asyncio.to_thread(self._worker.close)
        self._end_all(EngineClosedError("engine closed"))

    def _fail(self, reason: str) -> None:
        """An engine thread is gone: fail every open stream now and refuse new ones (any thread)."""
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = reason
        log.error("Orpheus engine failed: %s", reason)
        orphans = self._end_all(EngineFailedError(f"engine failed: {reason}"))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._cancel_generations, orphans)

    def _end_all(self, error: EngineError) -> list[CallerStream]:
        """End every open stream with `error`; the streams it ended."""
        with self._lock:
            orphans = list(self._open)
            self._open.clear()
        for stream in orphans:  # their callers are still waiting: tell them
            post(stream, error)
        return orphans

    @staticmethod
    def _cancel_generations(streams: list[CallerStream]) -> None:
        """Engine loop: stop generating for streams that have already been ended."""
        for stream in streams:
            if stream.task is not None:
                stream.task.cancel()

    def _decoder_died(self, exc: BaseException) -> None:
        self._fail(f"the decoder thread died: {type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- voices
    def add_voice(self, name: str, *, audio: str | Path | np.ndarray, transcript: str) -> None:
        """Add a cloned voice: `synthesize(text, voice=name)` then speaks in the voice of `audio` (zero-shot).

        `audio`: a 16-bit WAV file at 24 kHz, or a 1-D float (in [-1, 1]) or int16 array at 24 kHz, one frame
        (2,048 samples) to 30 s; `transcript`: the words it speaks. The reference is encoded once with SNAC's
        encoder and becomes the reference turn of every prompt of this voice (`prompt.reference_prompt`), a
        prefix the backend computes once (hf: its prefix store; vLLM and TensorRT-LLM: their prefix caching).
        Before `start()` it is only checked (encoded when the engine starts); after, it is encoded now, on the
        calling thread (a server runs this in a worker thread). TypeError/ValueError in one line for bad input.
        """
        voice = self._voices.check(name, audio, transcript, self.config.max_seq_len)
        if self.started:
            self._voices.encode(voice, self._tokenizer, self._encoder)
        self.spec = self._voices.add(voice)

    def remove_voice(self, name: str) -> None:
        """Remove an added voice (KeyError if `name` is not one) and free its reference's cached prefix."""
        voice, self.spec = self._voices.remove(name)
        forget = getattr(self._backend, "forget_prefix", None)
        if voice.reference is not None and forget is not None:
            forget(voice.reference)

    def voices(self) -> list[dict[str, Any]]:
        """Every voice: {"name", "kind": "stock"}, then each added one's {"name", "kind": "cloned", "seconds",
        "transcript", "prompt_ids" (its reference turn's length, None until encoded)}."""
        return self._voices.describe()

    def _encoder(self) -> Any:
        """The SNAC that encodes references: the decoder's, else (a null decoder) `config.snac`, loaded once."""
        if self._snac is None:
            from ..codec.snac import load_snac
            from .device import resolve_device

            self._snac = load_snac(self.config.snac, resolve_device(self.config.device))
        return self._snac

    # ---------------------------------------------------------------- synthesis
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
        cloned = self._voices.get(options.voice)
        reference = () if cloned is None else self._voices.encode(cloned, self._tokenizer, self._encoder)
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
                stream.taken += chunk.num_samples
                if stream.paused and stream.unread_s() <= self._resume_s:
                    with contextlib.suppress(RuntimeError):  # the engine loop is closed: nothing to resume
                        self._loop.call_soon_threadsafe(self._resume, stream)
                yield chunk
        finally:
            if not complete:
                stream.closed = True
                self._release(stream)  # the caller has left: its place is free now, its abort follows in a step
                self._count("streams_failed" if stream.box.ended else "streams_cancelled")
                if speculation is not None:  # ended before its end, unconfirmed: its audio will not be played
                    speculation.discard()
                with contextlib.suppress(RuntimeError):  # RuntimeError: the engine loop is already closed
                    self._loop.call_soon_threadsafe(self._cancel, stream)

    def _admit(self, stream: CallerStream) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            failure = self._failure or getattr(self._backend, "failure", None)
            if failure is not None:
                raise EngineFailedError(f"engine failed: {failure}")
            if len(self._open) >= self.config.max_streams:
                self._counters["streams_rejected"] += 1
                raise EngineOverloadedError(f"engine at capacity ({self.config.max_streams} streams)")
            self._open.add(stream)
            self._counters["streams_started"] += 1

    # ---------------------------------------------------------------- engine loop
    def _begin(
        self, stream: CallerStream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        if stream.closed or stream not in self._open:  # cancelled, or failed with the engine, before it began
            self._release(stream)
            self._generation_over(stream)
            return
        stream.task = self._loop.create_task(self._generate(stream, requests, token_log))

    async def _generate(
        self, stream: CallerStream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        worker = self._worker
        try:
            for i, (req, limit_kind) in enumerate(requests):
                utt = worker.open(stream, i, last=i == len(requests) - 1)
                await self._generate_utterance(utt, req, limit_kind, token_log)
                worker.end(utt)
        except asyncio.CancelledError:
            worker.drop(stream)
            if not stream.closed:  # not the caller's cancel: the engine is shutting down or failed
                post(stream, EngineClosedError("engine closed") if self._closed else EngineError("stream cancelled"))
            self._release(stream)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            worker.drop(stream)
            failure = getattr(self._backend, "failure", None)
            if failure is not None:  # the backend's thread died: nothing will be served any more
                self._fail(f"the {self.config.backend} backend failed: {failure}")
            err = exc if isinstance(exc, EngineError) else EngineError(str(exc))
            if err is not exc:
                err.__cause__ = exc
            post(stream, err)
            self._release(stream)
        finally:
            self._generation_over(stream)

    def _generation_over(self, stream: CallerStream) -> None:
        """Engine loop: `stream` generates no more; a speculation learns the audio generated for it."""
        if stream.speculation is not None:
            stream.speculation.ended(stream.frames * SAMPLES_PER_FRAME / SAMPLE_RATE)

    async def _generate_utterance(
        self, utt: Utterance, req: GenerationRequest, limit_kind: str, token_log: list[int] | None
    ) -> None:
        """Feed one request's tokens as frames to the decoder; its first token must come within the queue timeout."""
        parser = FrameParser(self.spec)
        tokens = self._backend.generate(req)
        ids_iter = tokens.__aiter__()
        n_tokens = 0
        try:
            while True:
                try:
                    if n_tokens == 0:
                        ids = await asyncio.wait_for(ids_iter.__anext__(), self.config.queue_timeout_s)
                    else:
                        ids = await ids_iter.__anext__()
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    self._count("queue_timeouts")
                    raise EngineOverloadedError(
                        f"no token within {self.config.queue_timeout_s:g} s (queue_timeout_s): the backend is full"
                    ) from None
                n_tokens += len(ids)
                frames = parser.feed(ids)
                if len(frames):
                    self._worker.push(utt, frames)
                    self._kick_soon()
                if token_log is not None:
                    token_log.extend(ids)
                if utt.stream.unread_s() > self._pause_s and isinstance(tokens, PausableStream):
                    await self._wait_for_reader(utt.stream, tokens)
        finally:
            await tokens.aclose()
            utt.stream.frames += parser.frames_out
            utt.stream.usage.output_tokens += n_tokens + (tokens.finish_reason == FinishReason.STOP)  # its end id
            self._count_utterance(parser, n_tokens, tokens.finish_reason, limit_kind)
        if token_log is not None:
            token_log.append(self.spec.end_of_speech)
        if tokens.finish_reason == FinishReason.ERROR:
            raise BackendError(f"backend failed request {req.request_id}")

    async def _wait_for_reader(self, stream: CallerStream, tokens: PausableStream) -> None:
        """Pause this stream's generation until its caller has read all but `pause_unread_s / 2` of its audio.

        `paused` is published before the caller's progress is read again, and the caller reads `paused` after
        publishing its progress, so one of the two always sees the other: no wake-up is lost.
        """
        event = stream.resumed = stream.resumed or asyncio.Event()
        event.clear()
        stream.paused = True
        try:
            if stream.unread_s() <= self._resume_s:
                return
            self._count("generation_pauses")
            tokens.pause(True)
            try:
                await event.wait()
            finally:
                tokens.pause(False)
        finally:
            stream.paused = False

    def _resume(self, stream: CallerStream) -> None:
        if stream.resumed is not None:
            stream.resumed.set()

    def _kick_soon(self) -> None:
        if not self._kick_pending:
            self._kick_pending = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_pending = False
        self._worker.kick()

    def _cancel(self, stream: CallerStream) -> None:
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()  # its handler drops decoder state and releases the stream
        else:
            self._worker.drop(stream)
            self._release(stream)

    def _stream_done(self, stream: CallerStream) -> None:
        """Decoder thread: the final chunk of `stream` is on its way to the caller."""
        self._count("streams_completed")
        self._release(stream)

    def _stream_failed(self, stream: CallerStream, error: EngineError) -> None:
        """Decoder thread: `stream` failed there (its error is on its way); stop generating for it."""
        self._count("streams_failed_in_decoder")
        self._release(stream)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, stream)

    def _release(self, stream: CallerStream) -> None:
        """Stop counting `stream` as active (once, whichever way it ended)."""
        with self._lock:
            held = stream in self._open
            self._open.discard(stream)
        if held and stream.speculation is not None:
            stream.speculation.released()

    # ---------------------------------------------------------------- metrics
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    def _count_utterance(self, parser: FrameParser, n_tokens: int, finish: str | None, limit_kind: str) -> None:
        reason = limit_kind if finish == FinishReason.LENGTH else finish
        with self._lock:
            self._counters["utterances"] += 1
            self._counters["tokens"] += n_tokens
            self._counters["frames"] += parser.frames_out
            self._counters[f"finish_{reason}"] += 1
            for key, n in parser.errors.items():
                self._counters[f"invalid_{key}"] += n

    def stats(self) -> dict[str, Any]:
        """Counters of the whole engine: active_streams, tokens, frames, finish reasons, bad ids, decoder calls, and
        speculative streams (`speculation.STAT_KEYS`: started, confirmed, discarded, and the discarded ones' audio
        seconds generated and stream-seconds held)."""
        health = self.health()
        with self._lock:
            out: dict[str, Any] = {"active_streams": len(self._open), **self._counters}
        out.update(self._speculations.stats())
        out["status"], out["failure"] = health["status"], health["reason"] if health["status"] == "failed" else None
        if self._worker is not None:
            out.update(self._worker.decoder.stats())
            out["decoder_ticks"] = self._worker.ticks
        if self._backend is not None:
            out["backend"] = self._backend.stats()
        return out

    @property
    def load(self) -> float:
        """Fraction of `max_streams` in use (what a LiveKit worker reports as its load)."""
        return len(self._open) / self.config.max_streams
