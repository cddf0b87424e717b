"""The process-wide Orpheus engine: admission, per-stream state, the decoder thread, cancellation, delivery.

Threads: the engine runs its own event loop in one thread (it drives the backend's token streams
and parses frames), decoding runs in one decoder thread, and audio reaches each caller's event loop
through one `call_soon_threadsafe` per loop per decoder tick. So one engine serves callers on any
number of event loops in any number of threads at once.

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
import ctypes
import ctypes.util
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .backends.protocol import BackendError, FinishReason, GenerationRequest, PausableStream, TokenBackend
from .codes import FrameParser
from .config import EngineConfig, SamplingOverrides, SamplingParams
from .errors import EngineClosedError, EngineError, EngineFailedError, EngineOverloadedError, ModelLoadError
from .mailbox import Mailbox
from .prompt import prompt_ids, token_budget
from .spec import SAMPLE_RATE, ModelSpec, spec_for
from .text import split_sentences

if TYPE_CHECKING:
    from .decoder import DecodeState, FrameDecoder

log = logging.getLogger(__name__)

# Counters stats() always has, zero until counted (the others appear when they first happen).
_STREAM_COUNTERS = ("streams_started", "streams_completed", "streams_cancelled", "streams_failed", "streams_rejected")
TRIM_INTERVAL_S = 1.0  # the idle decoder thread hands freed heap memory back to the OS at most this often


@dataclass(frozen=True)
class AudioChunk:
    """A piece of one stream's audio: int16 little-endian mono PCM.

    `utterance` is the index of the sentence it belongs to (as `OrpheusEngine.sentences` splits the text);
    `utterance_end` marks that sentence's last chunk, `final` the stream's.
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


class SpeechEngine(Protocol):
    """What the framework adapters use of an engine: `OrpheusEngine` in process, `RemoteEngine` over a socket."""

    config: Any  # .model and .backend name what it runs
    spec: ModelSpec

    def synthesize(
        self, text: str, *, voice: str | None = None, sampling: SamplingOverrides | None = None, **overrides: Any
    ) -> AsyncGenerator[AudioChunk, None]: ...

    def check_options(
        self, voice: str | None = None, sampling: SamplingOverrides | None = None, **overrides: Any
    ) -> tuple[str | None, SamplingParams]: ...

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


class _Stream:
    """Caller-side handle of one synthesize() stream; lives on the caller's event loop."""

    __slots__ = (
        "box",
        "closed",
        "first_audio_at",
        "id",
        "loop",
        "paused",
        "resumed",
        "samples",
        "task",
        "taken",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.id = uuid.uuid4().hex
        self.loop = loop
        self.closed = False  # set by the caller when it leaves early; read by every thread
        self.samples = 0  # written by the decoder thread only
        self.first_audio_at: float | None = None  # monotonic time its first audio left the decoder (decoder thread)
        self.task: asyncio.Task[None] | None = None  # the engine-loop task generating its tokens (engine loop only)
        self.box: Mailbox[AudioChunk] = Mailbox()  # caller's loop only
        self.taken = 0  # samples the caller has taken (caller's loop writes; the engine loop reads)
        self.paused = False  # generation waits for the caller to read (engine loop writes; caller's loop reads)
        self.resumed: asyncio.Event | None = None  # set when the caller has caught up (engine loop only)

    def unread_s(self) -> float:
        """Seconds of decoded audio on its way to the caller or waiting for it to take it."""
        return (self.samples - self.taken) / SAMPLE_RATE

    def put(self, item: AudioChunk | BaseException) -> None:
        """Runs on the caller's loop: a chunk, or the error that ends the stream (nothing after either end)."""
        if self.closed or self.box.ended:
            return
        if isinstance(item, BaseException):
            self.box.end(item)
        else:
            self.box.put(item)


@dataclass(eq=False)
class _Utterance:
    """One sentence of a stream on its way through the decoder; fields guarded by the worker's lock."""

    stream: _Stream
    index: int  # the sentence's place in the stream's text
    last: bool
    state: DecodeState  # decoder thread only, once opened
    incoming: list[np.ndarray] = field(default_factory=list)  # engine loop appends, decoder thread takes
    ended: bool = False  # set by the engine loop when generation of this utterance is over


class _DecodeWorker:
    """The decoder thread: each tick decodes the head utterance of every stream in batched calls and delivers.

    Only a stream's oldest unfinished utterance is decoded, so its sentences come out in order, each one
    whole. A stream whose delivered audio is more than `ahead_s` ahead of real time (counted from its
    first audio) has its frames held until the decoder's `ahead_chunk_frames` are pending, or until it
    is no longer that far ahead: a call of several frames costs less per frame (docs/benchmarks.md).
    `open`, `push`, `end` and `drop` run on the engine loop; everything else on the decoder thread.
    """

    def __init__(
        self,
        decoder: FrameDecoder,
        on_done: Callable[[_Stream], None],
        on_error: Callable[[_Stream, EngineError], None],
        on_dead: Callable[[BaseException], None],
        ahead_s: float | None = None,
    ):
        self.decoder = decoder
        self.ahead_s = math.inf if ahead_s is None else ahead_s  # None: never hold
        self._ahead_frames = decoder.ahead_chunk_frames
        self._on_done, self._on_error, self._on_dead = on_done, on_error, on_dead
        self._cv = threading.Condition()
        self._queues: dict[_Stream, collections.deque[_Utterance]] = {}  # under _cv; insertion order
        self._dropped: list[_Utterance] = []  # under _cv: states the decoder thread must release
        self._running = True
        self.ticks = 0  # decoder thread only
        self._trimmed_at = 0.0
        self._trimmed_tick = 0
        self._thread = threading.Thread(target=self._main, name="orpheus-decoder", daemon=True)
        self._thread.start()

    # -- engine loop side --
    def open(self, stream: _Stream, index: int, last: bool) -> _Utterance:
        utt = _Utterance(stream, index, last, self.decoder.new_state())
        with self._cv:
            self._queues.setdefault(stream, collections.deque()).append(utt)
        return utt

    def push(self, utt: _Utterance, frames: np.ndarray) -> None:
        """Queue frames; the decoder looks at them on its next tick or `kick()`."""
        with self._cv:
            utt.incoming.append(frames)

    def kick(self) -> None:
        """Wake the decoder thread (once per engine-loop iteration, not once per frame)."""
        with self._cv:
            self._cv.notify()

    def end(self, utt: _Utterance) -> None:
        with self._cv:
            utt.ended = True
            self._cv.notify()

    def drop(self, stream: _Stream) -> None:
        """Forget a stream: nothing of it is decoded any more (its decoder state is freed on the next tick)."""
        with self._cv:
            self._dropped.extend(self._queues.pop(stream, ()))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- decoder thread --
    def _collect(self) -> tuple[list[_Utterance], float]:
        """Under the lock: free dropped states, take new frames, and list the heads that can be decoded now,
        with the monotonic time at which a held head stops being held (inf if none is held)."""
        for utt in self._dropped:
            self.decoder.release(utt.state)
        self._dropped.clear()
        ready = []
        first = self.decoder.first_chunk_frames
        now, release_at = time.monotonic(), math.inf
        for queue in self._queues.values():
            utt = queue[0]
            if utt.incoming:
                utt.state.pending.extend(utt.incoming)
                utt.incoming.clear()
            utt.state.final = utt.ended
            if not utt.state.ready(first):
                continue
            stream = utt.stream
            until = held_until(utt.state, stream.first_audio_at, stream.samples, self.ahead_s, self._ahead_frames)
            if until > now:
                release_at = min(release_at, until)
            else:
                ready.append(utt)
        return ready, release_at

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - the engine must learn that its decoder is gone
            log.exception("Orpheus decoder thread died")
            self._on_dead(exc)

    def _run(self) -> None:
        while True:
            with self._cv:
                ready, release_at = self._collect()
                while self._running and not ready:
                    self._cv.wait(self._wait_s(release_at))
                    ready, release_at = self._collect()
                if not self._running:
                    return
            self._tick(ready)

    def _tick(self, ready: list[_Utterance]) -> None:
        try:
            results = self.decoder.decode([u.state for u in ready])
        except Exception as exc:  # noqa: BLE001 - a decoder bug fails the streams of this tick, not the engine
            results = [exc] * len(ready)
        self.ticks += 1
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, AudioChunk | BaseException]]] = {}
        done: list[_Stream] = []
        failed: list[tuple[_Stream, EngineError]] = []
        with self._cv:
            for utt, audio in zip(ready, results):
                stream = utt.stream
                if stream not in self._queues:  # dropped while this tick ran
                    continue
                if isinstance(audio, Exception):
                    error = EngineError(f"decoding failed: {type(audio).__name__}: {audio}")
                    error.__cause__ = audio
                    self._dropped.extend(self._queues.pop(stream))
                    failed.append((stream, error))
                    by_loop.setdefault(stream.loop, []).append((stream, error))
                    continue
                final = utt.last and utt.state.done
                if utt.state.done:
                    self._queues[stream].popleft()
                    if not self._queues[stream]:
                        del self._queues[stream]
                if stream.closed or (audio.size == 0 and not final):
                    continue
                chunk = AudioChunk(audio.tobytes(), stream.samples, final, SAMPLE_RATE, utt.index, utt.state.done)
                if stream.first_audio_at is None and audio.size:
                    stream.first_audio_at = time.monotonic()
                stream.samples += audio.size
                by_loop.setdefault(stream.loop, []).append((stream, chunk))
                if final:
                    done.append(stream)
        for stream in done:  # no longer active once its caller holds the final chunk
            self._on_done(stream)
        gone: list[_Stream] = []
        for loop, items in by_loop.items():  # before on_error: a failed stream's error reaches its caller first
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening; stop working for them
                gone += [stream for stream, _ in items]
        for stream, error in failed:
            self._on_error(stream, error)
        for stream in gone:
            stream.closed = True
            with self._cv:
                self._dropped.extend(self._queues.pop(stream, ()))
            self._on_error(stream, EngineError("the caller's event loop is closed"))

    def _wait_s(self, release_at: float) -> float | None:
        """How long the idle decoder thread may sleep: until a held stream is released, or an idle trim is due."""
        trim = self._idle_trim()
        if release_at == math.inf:
            return trim
        held = max(0.0, release_at - time.monotonic())
        return held if trim is None else min(held, trim)

    def _idle_trim(self) -> float | None:
        """With nothing to decode, hand the heap memory freed by decoding back to the OS (glibc keeps it
        otherwise), at most once a second; the seconds to wait before trying again, or None."""
        if self._queues or self.ticks == self._trimmed_tick or _MALLOC_TRIM is None:
            return None
        wait = self._trimmed_at + TRIM_INTERVAL_S - time.monotonic()
        if wait > 0:
            return wait
        self._trimmed_at, self._trimmed_tick = time.monotonic(), self.ticks
        _MALLOC_TRIM(0)
        return None


def held_until(
    state: DecodeState, first_audio_at: float | None, samples: int, ahead_s: float, ahead_frames: int
) -> float:
    """Monotonic time until which a ready utterance's pending frames wait for more (in the past: decode now).

    They wait while its stream's delivered audio (`samples`, from its first audio at `first_audio_at`) is
    more than `ahead_s` ahead of real time and fewer than `ahead_frames` are pending; a first chunk and an
    utterance's end never wait.
    """
    if state.final or state.frames_in == 0 or first_audio_at is None or state.pending_frames >= ahead_frames:
        return -math.inf
    return first_audio_at + samples / SAMPLE_RATE - ahead_s


def _progress(what: str) -> Callable[[int, int], None]:
    """A progress callback (done, total): a tqdm bar on stderr if tqdm is installed, else log lines."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda done, total: log.info("%s: %d/%d", what, done, total)
    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=what, unit="bucket"))
        bar[0].update(done - bar[0].n)
        if done == total:
            bar[0].close()

    return update


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def _failed(fut: concurrent.futures.Future[None]) -> bool:
    """Whether a done future ended without a result (an exception, or cancelled), without raising either."""
    return fut.cancelled() or fut.exception() is not None


def _deliver(items: list[tuple[_Stream, AudioChunk | BaseException]]) -> None:
    for stream, item in items:
        try:
            stream.put(item)
        except Exception as exc:  # noqa: BLE001 - one caller's failure must not stop delivery to the others
            stream.box.end(EngineError(f"delivery failed: {exc!r}"))


def _post(stream: _Stream, item: AudioChunk | BaseException) -> None:
    """Hand one item to a stream's own loop (dropped if that loop is gone)."""
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(_deliver, [(stream, item)])


class OrpheusEngine:
    """Text in, 24 kHz PCM out, for every caller in the process (see `synthesize`)."""

    _shared: dict[EngineConfig, OrpheusEngine] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        backend: TokenBackend | None = None,
        decoder: FrameDecoder | None = None,
    ):
        """An engine of `config`; `backend` and `decoder` replace the ones the config names (tests, benchmarks)."""
        self.config = config or EngineConfig()
        self.spec: ModelSpec = spec_for(self.config.model_family)
        self._custom_backend = backend
        self._custom_decoder = decoder
        self._lock = threading.Lock()  # guards _open, _counters, _closed, _failure, _started
        self._started: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._backend: TokenBackend | None = None  # engine loop only, once started
        self._worker: _DecodeWorker | None = None
        self._tokenizer: Any = None
        self._open: set[_Stream] = set()
        self._counters: collections.Counter[str] = collections.Counter(dict.fromkeys(_STREAM_COUNTERS, 0))
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
        with cls._shared_lock:
            engine = cls._shared.get(config)
            if engine is None or engine._closed:
                engine = cls._shared[config] = cls(config)
            return engine

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
                self._started = concurrent.futures.Future()
                self._thread = threading.Thread(
                    target=self._thread_main, args=(self._started,), name="orpheus-engine", daemon=True
                )
                self._thread.start()
            return self._started

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

    def _thread_main(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._boot())
        except BaseException as exc:  # noqa: BLE001 - handed to every start() caller
            log.debug("Orpheus engine failed to start: %s", exc)  # every start() caller gets the error itself
            if isinstance(exc, Exception) and not isinstance(exc, EngineError):
                error = ModelLoadError(f"the engine failed to load: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                exc = error
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by someone else
                started.set_exception(exc)
            loop.close()
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            started.set_result(None)
        try:
            loop.run_forever()
        finally:
            if not self._closed:
                self._fail("the engine loop stopped")
            loop.close()

    async def _boot(self) -> None:
        from .backends import make_backend, make_tokenizer
        from .decoder import make_decoder
        from .device import resolve_device
        from .weights import SNAC, TOKENIZER, load_error, require_weights

        cfg = self.config
        device = resolve_device(cfg.device)
        source = cfg.tokenizer or cfg.model
        try:
            await asyncio.to_thread(require_weights, "the tokenizer", source, TOKENIZER)
            self._tokenizer = await asyncio.to_thread(make_tokenizer, cfg)
        except (OSError, ValueError) as exc:
            raise load_error("the tokenizer", source, exc) from exc
        try:
            if self._custom_decoder is None and cfg.decoder == "snac":
                await asyncio.to_thread(require_weights, "SNAC", cfg.snac, SNAC)
            decoder = self._custom_decoder or await asyncio.to_thread(make_decoder, cfg, device)
        except (OSError, ValueError) as exc:
            raise load_error("SNAC", cfg.snac, exc) from exc
        if cfg.compile and hasattr(decoder, "warm"):  # compile (and capture) every bucket now, not on the hot path
            await asyncio.to_thread(decoder.warm, _progress("compiling decoder buckets"))
        self._backend = self._custom_backend or make_backend(cfg, self.spec, device)
        try:
            await self._backend.start()
        except (OSError, ValueError) as exc:
            raise load_error(f"the {cfg.backend} model", cfg.model, exc) from exc
        self._worker = _DecodeWorker(
            decoder, self._stream_done, self._stream_failed, self._decoder_died, cfg.decode_ahead_s
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
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        await asyncio.shield(asyncio.wrap_future(fut))  # a cancelled caller must not leave it half done
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)

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

    def _end_all(self, error: EngineError) -> list[_Stream]:
        """End every open stream with `error`; the streams it ended."""
        with self._lock:
            orphans = list(self._open)
            self._open.clear()
        for stream in orphans:  # their callers are still waiting: tell them
            _post(stream, error)
        return orphans

    @staticmethod
    def _cancel_generations(streams: list[_Stream]) -> None:
        """Engine loop: stop generating for streams that have already been ended."""
        for stream in streams:
            if stream.task is not None:
                stream.task.cancel()

    def _decoder_died(self, exc: BaseException) -> None:
        self._fail(f"the decoder thread died: {type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- synthesis
    def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        token_log: list[int] | None = None,
        **overrides: float | int | None,
    ) -> AsyncGenerator[AudioChunk, None]:
        """Speak `text`: an async generator of AudioChunk, the last with `final=True`.

        Sampling: `sampling` and/or keyword overrides (temperature, top_p, repetition_penalty,
        max_tokens, seed); None takes the engine's default. Sentence i of a long text is generated
        with seed + i, so it equals that sentence spoken alone with seed + i. Validates eagerly
        (TypeError/ValueError naming the field). Empty text yields nothing. Long text is split at
        sentence bounds and spoken in order, each sentence's audio whole before the next. Leaving
        the loop early, `aclose()` or cancelling the task aborts the generation within one engine
        step. `token_log`, if given, receives every generated id, each utterance closed by the
        end-of-speech id: what `orpheus-tts decode` replays.
        """
        voice, params = self.check_options(voice, sampling, **overrides)
        return self._synthesize(self.sentences(text), voice, params, token_log)

    def sentences(self, text: str) -> list[str]:
        """The sentences `synthesize(text)` speaks, one request each, in order (`AudioChunk.utterance` indexes them)."""
        return split_sentences(text, self.config.sentence_max_chars)

    def check_options(
        self, voice: str | None = None, sampling: SamplingOverrides | None = None, **overrides: float | int | None
    ) -> tuple[str | None, SamplingParams]:
        """The voice and sampling parameters a request would use; TypeError/ValueError naming what is wrong.

        Adapters call this when options change, so that bad input fails there and then rather
        than in the middle of a call.
        """
        voice = self.spec.check_voice(voice)
        return voice, SamplingOverrides.of(sampling, **overrides).apply(self.config.sampling)

    async def _synthesize(
        self, pieces: list[str], voice: str | None, sampling: SamplingParams, token_log: list[int] | None
    ) -> AsyncGenerator[AudioChunk, None]:
        if not pieces:
            return
        await self.start()
        stream = _Stream(asyncio.get_running_loop())
        requests = [self._request(stream, i, piece, voice, sampling) for i, piece in enumerate(pieces)]
        self._admit(stream)
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
                with contextlib.suppress(RuntimeError):  # RuntimeError: the engine loop is already closed
                    self._loop.call_soon_threadsafe(self._cancel, stream)

    def _request(
        self, stream: _Stream, i: int, text: str, voice: str | None, sampling: SamplingParams
    ) -> tuple[GenerationRequest, str]:
        cfg = self.config
        limit, kind = token_budget(text, cfg.token_budget_per_char, cfg.token_budget_base, sampling.max_tokens)
        seed = None if sampling.seed is None else (sampling.seed + i) % 2**63
        req = GenerationRequest(
            request_id=f"{stream.id}-{i}",
            prompt_ids=prompt_ids(self._tokenizer, self.spec, text, voice),
            sampling=replace(sampling, seed=seed),
            max_new_tokens=limit,
            stop_ids=self.spec.stop_ids(),
            constrain_audio=cfg.constrain_audio,
            priority=i > 0,  # a stream already speaking goes before new ones
        )
        return req, kind

    def _admit(self, stream: _Stream) -> None:
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
        self, stream: _Stream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        if stream.closed or stream not in self._open:  # cancelled, or failed with the engine, before it began
            self._release(stream)
            return
        stream.task = self._loop.create_task(self._generate(stream, requests, token_log))

    async def _generate(
        self, stream: _Stream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
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
                _post(stream, EngineClosedError("engine closed") if self._closed else EngineError("stream cancelled"))
            self._release(stream)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            worker.drop(stream)
            failure = getattr(self._backend, "failure", None)
            if failure is not None:  # the backend's thread died: nothing will be served any more
                self._fail(f"the {self.config.backend} backend failed: {failure}")
            err = exc if isinstance(exc, EngineError) else EngineError(str(exc))
            if err is not exc:
                err.__cause__ = exc
            _post(stream, err)
            self._release(stream)

    async def _generate_utterance(
        self, utt: _Utterance, req: GenerationRequest, limit_kind: str, token_log: list[int] | None
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
            self._count_utterance(parser, n_tokens, tokens.finish_reason, limit_kind)
        if token_log is not None:
            token_log.append(self.spec.end_of_speech)
        if tokens.finish_reason == FinishReason.ERROR:
            raise BackendError(f"backend failed request {req.request_id}")

    async def _wait_for_reader(self, stream: _Stream, tokens: PausableStream) -> None:
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

    def _resume(self, stream: _Stream) -> None:
        if stream.resumed is not None:
            stream.resumed.set()

    def _kick_soon(self) -> None:
        if not self._kick_pending:
            self._kick_pending = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_pending = False
        self._worker.kick()

    def _cancel(self, stream: _Stream) -> None:
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()  # its handler drops decoder state and releases the stream
        else:
            self._worker.drop(stream)
            self._release(stream)

    def _stream_done(self, stream: _Stream) -> None:
        """Decoder thread: the final chunk of `stream` is on its way to the caller."""
        self._count("streams_completed")
        self._release(stream)

    def _stream_failed(self, stream: _Stream, error: EngineError) -> None:
        """Decoder thread: `stream` failed there (its error is on its way); stop generating for it."""
        self._count("streams_failed_in_decoder")
        self._release(stream)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, stream)

    def _release(self, stream: _Stream) -> None:
        """Stop counting `stream` as active (once, whichever way it ended)."""
        with self._lock:
            self._open.discard(stream)

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
        """Counters of the whole engine: active_streams, tokens, frames, finish reasons, bad ids, decoder calls."""
        health = self.health()
        with self._lock:
            out: dict[str, Any] = {"active_streams": len(self._open), **self._counters}
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
