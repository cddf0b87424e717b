"""The process-wide Orpheus engine: admission, per-stream state, cancellation, metrics, delivery.

Threads: the engine runs its own event loop in one thread (it drives the backend's token
streams and parses frames), decoding runs in one decoder thread, and audio reaches each
caller's event loop through one `call_soon_threadsafe` per loop per decoder tick. So one
engine serves callers on any number of event loops in any number of threads at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.base import BackendError, FinishReason, GenerationRequest, TokenBackend
from .codes import FrameParser
from .config import EngineConfig, SamplingOverrides, SamplingParams
from .errors import EngineClosedError, EngineError, EngineOverloadedError
from .mailbox import Mailbox
from .prompt import prompt_ids, token_budget
from .spec import SAMPLE_RATE, ModelSpec, spec_for
from .text import split_sentences

if TYPE_CHECKING:
    from .decoder import DecodeState, FrameDecoder


@dataclass(frozen=True)
class AudioChunk:
    """A piece of one stream's audio: int16 little-endian mono PCM."""

    pcm: bytes
    start_sample: int
    final: bool
    sample_rate: int = SAMPLE_RATE

    @property
    def num_samples(self) -> int:
        return len(self.pcm) // 2


class _Stream:
    """Caller-side handle of one synthesize() stream; lives on the caller's event loop."""

    __slots__ = ("box", "closed", "id", "loop", "samples", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.id = uuid.uuid4().hex
        self.loop = loop
        self.closed = False  # set by the caller when it leaves early; read by every thread
        self.samples = 0  # written by the decoder thread only
        self.task: asyncio.Task[None] | None = None  # the engine-loop task generating its tokens
        self.box: Mailbox[AudioChunk] = Mailbox()

    def put(self, item: AudioChunk | BaseException) -> None:
        """Runs on the caller's loop: a chunk, or the error that ends the stream (nothing after either end)."""
        if self.closed or self.box.ended:
            return
        if isinstance(item, BaseException):
            self.box.end(item)
        else:
            self.box.put(item)


@dataclass
class _Utterance:
    stream: _Stream
    last: bool
    state: DecodeState
    incoming: list[np.ndarray] = field(default_factory=list)
    ended: bool = False


class _DecodeWorker:
    """The decoder thread: each tick decodes every ready utterance in batched calls and delivers."""

    def __init__(self, decoder: FrameDecoder, on_done: Any):
        self.decoder = decoder
        self._on_done = on_done
        self._cv = threading.Condition()
        self._live: list[_Utterance] = []
        self._running = True
        self.ticks = 0
        self._thread = threading.Thread(target=self._run, name="orpheus-decoder", daemon=True)
        self._thread.start()

    def open(self, stream: _Stream, last: bool) -> _Utterance:
        utt = _Utterance(stream, last, self.decoder.new_state())
        with self._cv:
            self._live.append(utt)
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
        with self._cv:
            self._live = [u for u in self._live if u.stream is not stream]

    def close(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join()

    def _ready(self) -> list[_Utterance]:
        ready = []
        first = self.decoder.first_chunk_frames
        for utt in self._live:
            if utt.incoming:
                utt.state.pending.extend(utt.incoming)
                utt.incoming.clear()
            utt.state.final = utt.ended
            if utt.state.ready(first):
                ready.append(utt)
        return ready

    def _run(self) -> None:
        while True:
            with self._cv:
                ready = self._ready()
                while self._running and not ready:
                    self._cv.wait()
                    ready = self._ready()
                if not self._running:
                    return
            pcm = self.decoder.decode([u.state for u in ready])
            self.ticks += 1
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, AudioChunk]]] = {}
            done: list[_Stream] = []
            for utt, audio in zip(ready, pcm):
                stream = utt.stream
                if stream.closed:
                    continue
                final = utt.last and utt.state.done
                if audio.size == 0 and not final:
                    continue
                chunk = AudioChunk(audio.tobytes(), stream.samples, final)
                stream.samples += audio.size
                by_loop.setdefault(stream.loop, []).append((stream, chunk))
                if final:
                    done.append(stream)
            with self._cv:
                finished = {id(u) for u in ready if u.state.done}
                self._live = [u for u in self._live if id(u) not in finished]
            for stream in done:
                self._on_done(stream)
            for loop, items in by_loop.items():
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening
                    loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[_Stream, AudioChunk | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


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
        self._lock = threading.Lock()
        self._started: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._backend: TokenBackend | None = None
        self._worker: _DecodeWorker | None = None
        self._tokenizer: Any = None
        self._open: set[_Stream] = set()
        self._counters: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._kick_pending = False

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
    async def start(self) -> None:
        """Load the tokenizer, backend and decoder once; safe to await from any loop, any number of times."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if self._started is None:
                self._started = concurrent.futures.Future()
                self._thread = threading.Thread(target=self._thread_main, name="orpheus-engine", daemon=True)
                self._thread.start()
        await asyncio.wrap_future(self._started)

    @property
    def started(self) -> bool:
        return self._started is not None and self._started.done() and self._started.exception() is None

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._boot())
        except BaseException as exc:  # noqa: BLE001 - handed to every start() caller
            self._started.set_exception(exc)
            loop.close()
            return
        self._started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _boot(self) -> None:
        from .backends import make_backend, make_tokenizer
        from .decoder import make_decoder

        cfg = self.config
        device = cfg.resolved_device()
        self._tokenizer = await asyncio.to_thread(make_tokenizer, cfg)
        decoder = self._custom_decoder or await asyncio.to_thread(make_decoder, cfg, device)
        self._backend = self._custom_backend or make_backend(cfg, self.spec, device)
        await self._backend.start()
        self._worker = _DecodeWorker(decoder, self._stream_done)

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
            await asyncio.wrap_future(started)
        except BaseException:  # noqa: BLE001 - a failed start leaves nothing to stop
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        await asyncio.wrap_future(fut)
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._backend.close()
        await asyncio.to_thread(self._worker.close)
        with self._lock:
            orphans = list(self._open)
        for stream in orphans:  # their callers are still waiting: tell them
            _post(stream, EngineClosedError("engine closed"))
            self._release(stream)

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
        max_tokens, seed); None takes the engine's default. Validates eagerly (TypeError/ValueError
        naming the field). Empty text yields nothing. Long text is split at sentence bounds and
        spoken in order. Leaving the loop early, `aclose()` or cancelling the task aborts the
        generation within one engine step. `token_log`, if given, receives every generated id, each
        utterance closed by the end-of-speech id: what `orpheus-tts decode` replays.
        """
        voice, params = self.check_options(voice, sampling, **overrides)
        pieces = split_sentences(text, self.config.sentence_max_chars)
        return self._synthesize(pieces, voice, params, token_log)

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
                yield chunk
        finally:
            if not complete:
                stream.closed = True
                self._count("streams_failed" if stream.box.ended else "streams_cancelled")
                with contextlib.suppress(RuntimeError):  # RuntimeError: the engine loop is already closed
                    self._loop.call_soon_threadsafe(self._cancel, stream)

    def _request(
        self, stream: _Stream, i: int, text: str, voice: str | None, sampling: SamplingParams
    ) -> tuple[GenerationRequest, str]:
        cfg = self.config
        limit, kind = token_budget(text, cfg.token_budget_per_char, cfg.token_budget_base, sampling.max_tokens)
        req = GenerationRequest(
            request_id=f"{stream.id}-{i}",
            prompt_ids=prompt_ids(self._tokenizer, self.spec, text, voice),
            sampling=sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i),
            max_new_tokens=limit,
            stop_ids=self.spec.stop_ids(),
            constrain_audio=cfg.constrain_audio,
        )
        return req, kind

    def _admit(self, stream: _Stream) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if len(self._open) >= self.config.max_streams:
                self._counters["streams_rejected"] += 1
                raise EngineOverloadedError(f"engine at capacity ({self.config.max_streams} streams)")
            self._open.add(stream)
            self._counters["streams_started"] += 1

    # ---------------------------------------------------------------- engine loop
    def _begin(
        self, stream: _Stream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        if stream.closed:
            self._release(stream)
            return
        stream.task = self._loop.create_task(self._generate(stream, requests, token_log))

    async def _generate(
        self, stream: _Stream, requests: list[tuple[GenerationRequest, str]], token_log: list[int] | None
    ) -> None:
        worker = self._worker
        try:
            for i, (req, limit_kind) in enumerate(requests):
                utt = worker.open(stream, last=i == len(requests) - 1)
                parser = FrameParser(self.spec)
                tokens = self._backend.generate(req)
                n_tokens = 0
                try:
                    async for ids in tokens:
                        n_tokens += len(ids)
                        frames = parser.feed(ids)
                        if len(frames):
                            worker.push(utt, frames)
                            self._kick_soon()
                        if token_log is not None:
                            token_log.extend(ids)
                finally:
                    await tokens.aclose()
                    self._count_utterance(parser, n_tokens, tokens.finish_reason, limit_kind)
                if token_log is not None:
                    token_log.append(self.spec.end_of_speech)
                if tokens.finish_reason == FinishReason.ERROR:
                    raise BackendError(f"backend failed request {req.request_id}")
                worker.end(utt)
        except asyncio.CancelledError:
            worker.drop(stream)
            if not stream.closed:  # not the caller's cancel: the engine is shutting down
                _post(stream, EngineClosedError("engine closed"))
            self._release(stream)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            worker.drop(stream)
            err = exc if isinstance(exc, EngineError) else EngineError(str(exc))
            err.__cause__ = exc
            _post(stream, err)
            self._release(stream)

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
        with self._lock:
            out: dict[str, Any] = {"active_streams": len(self._open), **self._counters}
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
