"""`RemoteEngine`: OrpheusEngine's interface over one persistent WebSocket to `orpheus-tts serve`.

Threads: the connection lives on the RemoteEngine's own event loop in one daemon thread (started by
`start()` or `prewarm()`). Callers on any loop in any thread hand requests to it with
`call_soon_threadsafe` and get their chunks back the same way, batched: one call per caller loop per
turn of the connection's loop. So, like OrpheusEngine, one RemoteEngine (one socket) serves every
caller of a process. Create it in the process that uses it: its thread does not survive a fork.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import ssl as ssl_module
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..config import EngineConfig, SamplingOverrides, SamplingParams
from ..engine import AudioChunk
from ..errors import EngineClosedError, EngineError, EngineOverloadedError
from ..mailbox import Mailbox
from ..spec import SPECS, ModelSpec, spec_for
from ..text import split_sentences
from . import protocol
from .connection import Connection, Item, endpoint, to_mailbox


@dataclass(frozen=True)
class RemoteConfig:
    """Where a RemoteEngine connects and the model it names: what adapters read as `engine.config`."""

    url: str
    model: str | None = None  # a label only (adapters show it); the server decides what it runs
    model_family: str = "orpheus-en"
    backend: str = "serve"


class _CallerStream:
    """One synthesize() call: created on the caller's loop; `box` is read there only."""

    __slots__ = ("box", "closed", "conn", "loop", "put", "sid")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.box: Mailbox[AudioChunk] = Mailbox()
        self.put = to_mailbox(self.box)  # caller's loop only
        self.closed = False  # set by the caller when it leaves early; read on the connection's loop
        self.conn: Connection | None = None  # connection's loop only
        self.sid: int | None = None  # connection's loop only


def _deliver(items: list[tuple[_CallerStream, Item]]) -> None:
    """Runs on a caller's loop: hand each item to its stream, unless the caller already left."""
    for stream, item in items:
        if not stream.closed:
            stream.put(item)


class _Outbound:
    """Items bound for callers' loops: one call_soon_threadsafe per caller loop per turn (connection's loop only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_gone: Callable[[_CallerStream], None]):
        self._loop = loop
        self._on_gone = on_gone  # called with a stream whose caller's loop is closed
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[_CallerStream, Item]]] = {}

    def post(self, stream: _CallerStream, item: Item) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.setdefault(stream.loop, []).append((stream, item))

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that caller's loop is closed: nobody listens; stop the server's work for it
                for stream, _ in items:
                    stream.closed = True
                    self._on_gone(stream)


class RemoteEngine:
    """Text in, 24 kHz PCM out, from an `orpheus-tts serve` server: the OrpheusEngine interface adapters use.

    `synthesize`, `check_options`, `start`, `prewarm`, `aclose`, `health`, `ready`, `stats`, `load`,
    `config` (`.model`, `.backend`) and `spec` (voices) behave as OrpheusEngine's do. Voices and
    sampling are checked locally: against the model family's voices until the server's hello, then
    against what the server said it accepts. A lost connection ends the calls it carried with an
    EngineError at once and is re-opened with exponential backoff (jittered); server errors arrive as
    the same exception classes (at capacity → EngineOverloadedError, bad input → ValueError/TypeError).
    """

    _shared: ClassVar[dict[tuple[int, RemoteConfig], RemoteEngine]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        model_family: str = "orpheus-en",
        ssl: ssl_module.SSLContext | None = None,
        connect_timeout_s: float = 5.0,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        api_key: str | None = None,
    ):
        """`url`: ws://HOST:PORT (or wss://, http(s)://, unix:/PATH); `ssl` for wss with a private CA;
        `connect_timeout_s`: how long start() and a call wait for a connection; `backoff_s`: first and
        longest wait between reconnection attempts; `api_key`: the server's key (default $ORPHEUS_API_KEY)."""
        endpoint(url)  # a malformed URL fails here, not in the background
        self.config = RemoteConfig(url, model, model_family)
        self.spec: ModelSpec = spec_for(model_family)  # replaced at each hello (connection's loop writes)
        self.sampling = SamplingParams()  # the server's defaults, replaced at each hello
        self._sentence_max_chars = EngineConfig().sentence_max_chars  # the server's, replaced at each hello
        self._ssl = ssl
        self._api_key = api_key  # None: Connection.open takes $ORPHEUS_API_KEY
        self._connect_timeout_s = connect_timeout_s
        self._backoff = backoff_s
        self._lock = threading.Lock()  # guards _thread, _closed, _counters
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the connection's loop, once the thread runs
        self._closed = False
        self._counters: collections.Counter[str] = collections.Counter()
        # The rest belongs to the connection's loop (other threads only read the references).
        self._conn: Connection | None = None
        self._status: dict[str, Any] = {}
        self._last_error: str | None = None
        self._open: set[_CallerStream] = set()
        self._up = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._outbound: _Outbound | None = None

    @classmethod
    def shared(cls, url: str, **options: Any) -> RemoteEngine:
        """The process-wide RemoteEngine for `url` (one socket for the whole process); `options` apply on creation."""
        key = (os.getpid(), RemoteConfig(url, options.get("model"), options.get("model_family", "orpheus-en")))
        with cls._shared_lock:
            engine = cls._shared.get(key)
            if engine is None or engine._closed:
                engine = cls._shared[key] = cls(url, **options)
            return engine

    # ---------------------------------------------------------------- lifecycle
    def prewarm(self) -> None:
        """Start connecting in the background and return at once (from any thread)."""
        self._ensure_thread()

    async def start(self) -> None:
        """Wait until connected (up to `connect_timeout_s`); EngineError if the server cannot be reached."""
        self._ensure_thread()
        if self._conn is None:
            fut = asyncio.run_coroutine_threadsafe(self._wait_up(self._connect_timeout_s), self._loop)
            await asyncio.wrap_future(fut)

    @property
    def started(self) -> bool:
        """Connected now."""
        return self._conn is not None

    @property
    def ready(self) -> bool:
        """Connected, and the server's engine serves new streams (not loading, failed or draining)."""
        return self.health()["status"] == "ok" and not self._status.get("draining", False)

    def health(self) -> dict[str, Any]:
        """{"status": "not started" | "starting" (connecting) | "ok" | "failed" | "closed", "reason"}."""
        if self._closed:
            return {"status": "closed", "reason": "aclose() was called"}
        if self._thread is None:
            return {"status": "not started", "reason": "start() or prewarm() not called yet"}
        if self._conn is None:
            return {"status": "starting", "reason": f"connecting to {self.config.url}: {self._last_error or '...'}"}
        status = self._status.get("status", "ok")
        return {"status": status, "reason": None if status == "ok" else self._status.get("reason")}

    @property
    def load(self) -> float:
        """The server's load (fraction of its max_streams in use); 1.0 while not connected (it can take no call)."""
        if self._conn is None:
            return 1.0
        return float(self._status.get("load", 0.0))

    def stats(self) -> dict[str, Any]:
        """This process's streams (active_streams, started, completed, cancelled, failed, rejected), connects,
        and the server's last status (load, readiness); `await server_stats()` has the server's own counters."""
        with self._lock:
            counters = dict(self._counters)
        return {
            "active_streams": len(self._open),
            **counters,
            "connected": self._conn is not None,
            "load": self.load,
            "status": self.health()["status"],
            "server": dict(self._status),
        }

    async def server_stats(self) -> dict[str, Any]:
        """The server's own stats (engine counters, backend, process CPU seconds)."""
        await self.start()
        conn = self._conn
        if conn is None:
            raise EngineError(f"not connected to {self.config.url}")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(conn.server_stats(), self._loop))

    async def aclose(self) -> None:
        """End every open call with EngineClosedError, close the socket and the thread. Cannot be restarted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop))
        await asyncio.to_thread(thread.join)

    # ---------------------------------------------------------------- options
    def check_options(
        self, voice: str | None = None, sampling: SamplingOverrides | None = None, **overrides: float | int | None
    ) -> tuple[str | None, SamplingParams]:
        """The voice and sampling a request would use; TypeError/ValueError naming what is wrong (checked locally)."""
        voice = self.spec.check_voice(voice)
        return voice, SamplingOverrides.of(sampling, **overrides).apply(self.sampling)

    def sentences(self, text: str) -> list[str]:
        """The sentences `synthesize(text)` speaks, in order, as the server splits them (`AudioChunk.utterance`)."""
        return split_sentences(text, self._sentence_max_chars)

    # ---------------------------------------------------------------- synthesis
    def synthesize(
        self, text: str, *, voice: str | None = None, sampling: SamplingOverrides | None = None, **overrides: Any
    ) -> AsyncGenerator[AudioChunk, None]:
        """Speak `text` on the server: AudioChunks as OrpheusEngine.synthesize yields them (validated eagerly).

        Leaving the loop early, `aclose()` or cancelling the task sends `cancel` at once.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        self.check_options(voice, sampling, **overrides)
        return self._synthesize(protocol.Start(text, voice, SamplingOverrides.of(sampling, **overrides)))

    async def _synthesize(self, request: protocol.Start) -> AsyncGenerator[AudioChunk, None]:
        if self._closed:
            raise EngineClosedError("RemoteEngine is closed")
        await self.start()
        stream = _CallerStream(asyncio.get_running_loop())
        self._loop.call_soon_threadsafe(self._begin, stream, request)
        self._count("streams_started")
        outcome = "streams_cancelled"
        try:
            while True:
                try:
                    chunk = await stream.box.get()
                except StopAsyncIteration:
                    outcome = "streams_completed"
                    return
                if chunk.final:
                    outcome = "streams_completed"
                yield chunk
                if chunk.final:
                    return
        except EngineOverloadedError:
            outcome = "streams_rejected"
            raise
        except (EngineError, ValueError, TypeError):
            outcome = "streams_failed"
            raise
        finally:
            self._count(outcome)
            if outcome == "streams_cancelled":
                stream.closed = True
                with contextlib.suppress(RuntimeError):  # the connection's loop is gone: nothing to cancel
                    self._loop.call_soon_threadsafe(self._cancel, stream)

    def _count(self, key: str) -> None:
        with self._lock:
            self._counters[key] += 1

    # ---------------------------------------------------------------- the connection's loop
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("RemoteEngine is closed")
            if self._thread is not None:
                return
            running = threading.Event()
            self._thread = threading.Thread(target=self._main, args=(running,), name="orpheus-remote", daemon=True)
            self._thread.start()
        running.wait()

    def _main(self, running: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._outbound = _Outbound(loop, self._cancel)
        self._keeper = loop.create_task(self._keep_connected())
        running.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _keep_connected(self) -> None:
        """Connect, serve until the socket closes, reconnect with jittered exponential backoff; for ever."""
        first, longest = self._backoff
        delay = first
        while not self._closed:
            try:
                conn = await Connection.open(
                    self.config.url,
                    ssl=self._ssl,
                    api_key=self._api_key,
                    timeout_s=self._connect_timeout_s,
                    on_status=self._on_status,
                    on_close=self._on_close,
                )
            except EngineError as exc:
                self._last_error = str(exc)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, longest)
                continue
            delay = first
            self._adopt(conn)
            await conn.closed

    def _adopt(self, conn: Connection) -> None:
        """A new connection: take the server's voices and sampling defaults, and let waiting callers in."""
        hello = conn.hello
        base = SPECS.get(hello.model_family) or ModelSpec(name=hello.model_family)
        self.spec = replace(base, voices=hello.voices, default_voice=hello.default_voice)
        self.sampling = hello.sampling
        self._sentence_max_chars = hello.sentence_max_chars
        self._status = conn.status
        self._conn = conn
        self._count("connects")
        self._up.set()

    def _on_status(self, message: dict[str, Any]) -> None:
        self._status = message

    def _on_close(self, reason: str) -> None:
        """The connection closed: forget it before any of its calls hears of it (health and load say so)."""
        self._last_error = reason
        self._conn = None
        self._up.clear()

    async def _wait_up(self, timeout_s: float) -> None:
        if self._conn is None and not self._closed:
            try:
                await asyncio.wait_for(self._up.wait(), timeout_s)
            except asyncio.TimeoutError:
                raise EngineError(
                    f"cannot reach {self.config.url} within {timeout_s:g} s: {self._last_error or 'no answer'}"
                ) from None
        if self._closed:
            raise EngineClosedError("RemoteEngine is closed")

    def _begin(self, stream: _CallerStream, request: protocol.Start) -> None:
        if stream.closed:
            return
        conn = self._conn
        if conn is None or conn.closed.done():
            self._outbound.post(stream, EngineError(f"connection to {self.config.url} lost: {self._last_error}"))
            return
        self._open.add(stream)
        stream.conn = conn
        stream.sid = conn.start(request, lambda item: self._arrive(stream, item))

    def _arrive(self, stream: _CallerStream, item: Item) -> None:
        if not isinstance(item, AudioChunk) or item.final:
            self._open.discard(stream)
        self._outbound.post(stream, item)

    def _cancel(self, stream: _CallerStream) -> None:
        self._open.discard(stream)
        if stream.conn is not None and stream.sid is not None:
            stream.conn.cancel(stream.sid)

    async def _shutdown(self) -> None:
        self._keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeper
        if self._conn is not None:
            await self._conn.aclose(EngineClosedError("RemoteEngine closed"))
        self._up.set()  # waiting callers see _closed
        self._outbound.flush()
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)
