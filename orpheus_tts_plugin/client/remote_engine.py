"""`RemoteEngine`: OrpheusEngine's interface over one persistent WebSocket to each of its `orpheus-tts serve` servers
(behind Ray Serve's proxy: a hello, then an HTTP request per stream, `stream_posts`).

Threads: the connections live on the RemoteEngine's own event loop in one daemon thread (started by
`start()` or `prewarm()`). Callers on any loop in any thread hand requests to it with
`call_soon_threadsafe` and get their chunks back the same way, batched: one call per caller loop per
turn of the connection's loop. So, like OrpheusEngine, one RemoteEngine (one socket per server) serves
every caller of a process. Create it in the process that uses it: its thread does not survive a fork.
With several servers, each new stream goes to the least-loaded one that serves (`upstream.choose`).

This module is the front end (the callers' side, and the engine's life); its parts: `settings` (its arguments),
`pool` (the servers and their connections), `router` (where each stream goes, failover), `server_terms` (what the
servers accept: voices, sampling, limits) and `stats` (counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl as ssl_module
import threading
from collections.abc import AsyncGenerator, Sequence
from typing import Any, ClassVar

from ..config import SamplingOverrides, SamplingParams, check_text_length
from ..errors import EngineClosedError, EngineError, EngineOverloadedError
from ..runtime.loop_thread import LoopThread, SharedInstances
from ..spec import SAMPLE_RATE, ModelSpec
from ..speculation import Speculation, SpeculationTally
from ..speech.text import split_sentences
from ..types import AudioChunk, Speech, SpeechOptions
from ..wire import protocol
from .connection import Connection
from .pool import ServerPool
from .router import CallerStream, Router
from .server_terms import ServerTerms
from .settings import ConnectOptions, RemoteConfig
from .stats import Counters, by_server
from .upstream import server_urls


class RemoteEngine:
    """Text in, 24 kHz PCM out, from `orpheus-tts serve` servers: the OrpheusEngine interface adapters use.

    `synthesize`, `check_options`, `start`, `prewarm`, `aclose`, `health`, `ready`, `stats`, `load`,
    `config` (`.model`, `.backend`) and `spec` (voices) behave as OrpheusEngine's do. Voices and
    sampling are checked locally: against the model family's voices until a server's hello, then
    against what the server said it accepts. A lost connection ends the calls it carried with an
    EngineError at once (a call with no audio yet goes to another live server instead, until
    `connect_timeout_s` after it began) and is re-opened with exponential backoff (jittered); server errors
    arrive as the same exception classes (at capacity → EngineOverloadedError, bad input →
    ValueError/TypeError); a refused API key is KeyRefusedError, at once.
    Given several servers (all serving the same model), it keeps one connection to each and sends each
    new stream to the least-loaded one that serves; one that drops or drains gets no new streams.
    """

    _shared: ClassVar[SharedInstances[tuple[int, RemoteConfig], RemoteEngine]] = SharedInstances(
        lambda engine: engine._closed
    )

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        model: str | None = None,
        model_family: str = "orpheus-en",
        ssl: ssl_module.SSLContext | None = None,
        connect_timeout_s: float = 5.0,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        keepalive_s: tuple[float, float] | None = (1.0, 3.0),
        api_key: str | None = None,
    ):
        """`url`: ws://HOST:PORT (or wss://, http(s)://, unix:/PATH), or several servers as a sequence or a
        comma-separated string; `ssl` for wss with a private CA; `connect_timeout_s`: how long start() and a
        call wait for a connection; `backoff_s`: first and longest wait between reconnection attempts, per
        server; `keepalive_s`: ping each server this often and drop one that leaves a ping unanswered this
        long (a hung or unreachable machine; None: never; behind Ray Serve's proxy, where no socket is held, a
        stream that hears nothing for `stream_posts.SILENCE_S` is lost instead); `api_key`: the servers' key
        (default $ORPHEUS_API_KEY)."""
        self.config = RemoteConfig(",".join(server_urls(url)), model, model_family)
        self._options = ConnectOptions(ssl, api_key, connect_timeout_s, backoff_s, keepalive_s)
        self._lock = threading.Lock()  # guards _thread, _closed
        self._thread: LoopThread | None = None  # the connection's loop, from the first start() or prewarm()
        self._closed = False
        self._counters = Counters()  # any thread: its own lock
        self._speculations = SpeculationTally()  # this process's speculative streams (any thread: its own lock)
        # The rest belongs to the connection's loop (other threads only read the references).
        self._terms = ServerTerms(model_family)
        self._pool = ServerPool(self.config, self._options, lambda: self._closed, self._adopt, self._take_listed_voices)
        self._router = Router(self._pool, connect_timeout_s, lambda: self._closed, self._counters.count)

    @classmethod
    def shared(cls, url: str | Sequence[str], **options: Any) -> RemoteEngine:
        """The process-wide RemoteEngine for `url` (one socket per server for the whole process); `options`
        apply on creation."""
        joined = ",".join(server_urls(url))
        key = (os.getpid(), RemoteConfig(joined, options.get("model"), options.get("model_family", "orpheus-en")))
        return cls._shared.get(key, lambda: cls(joined, **options))

    # ---------------------------------------------------------------- what the servers accept
    @property
    def spec(self) -> ModelSpec:
        """The model's voices and tokens as the servers said (the model family's until a hello)."""
        return self._terms.spec

    @property
    def sampling(self) -> SamplingParams:
        """The servers' sampling defaults (the local defaults until a hello)."""
        return self._terms.sampling

    @property
    def adapters(self) -> tuple[str, ...]:
        """The servers' LoRA adapters."""
        return self._terms.adapters

    # ---------------------------------------------------------------- lifecycle
    def prewarm(self) -> None:
        """Start connecting in the background and return at once (from any thread)."""
        self._ensure_thread()

    async def start(self, *, every_server: bool = False) -> None:
        """Wait until connected to a server (to each, if `every_server`), up to `connect_timeout_s`; EngineError
        naming the servers that cannot be reached. With several servers it also waits, within that time, until
        each has connected or failed once, so that a burst of streams right after it spreads over them all."""
        self._ensure_thread()
        if not self._pool.spread(every_server):
            await self._thread.run(self._pool.wait_up(self._options.connect_timeout_s, every_server))

    @property
    def started(self) -> bool:
        """Connected now (to one server at least)."""
        return self._pool.reached(False)

    @property
    def ready(self) -> bool:
        """Connected to a server whose engine serves new streams (not loading, failed or draining)."""
        return not self._closed and self._pool.usable

    def health(self) -> dict[str, Any]:
        """{"status": "not started" | "starting" (connecting) | "ok" | "failed" | "closed", "reason"}: "ok" while
        any server serves; otherwise what the first connected server says of itself."""
        if self._closed:
            return {"status": "closed", "reason": "aclose() was called"}
        if self._thread is None:
            return {"status": "not started", "reason": "start() or prewarm() not called yet"}
        return self._pool.health()

    @property
    def load(self) -> float:
        """The servers' mean load (fraction of max_streams in use); a server not connected, draining or not
        serving counts as full (1.0: it can take no call)."""
        return self._pool.load

    def stats(self) -> dict[str, Any]:
        """This process's streams (active_streams, started, completed, cancelled, failed, rejected), connects,
        failovers (streams sent on to another server, theirs lost before their first audio), and each server's last
        status (`servers`, by URL; with one URL also `server`); `await server_stats()` has a server's own counters.
        Its `speculative_*` count this process's speculative streams as OrpheusEngine's do, with the audio received
        (not generated) and the time open as their cost."""
        upstreams = self._pool.upstreams
        out = {
            "active_streams": len(self._router.open),
            **self._counters.snapshot(),
            "connected": self.started,
            "load": self.load,
            "status": self.health()["status"],
            "servers": by_server(upstreams, self._router.open),
            **self._speculations.stats(),
        }
        if len(upstreams) == 1:
            out["server"] = dict(upstreams[0].status)
        return out

    async def server_stats(self, url: str | None = None) -> dict[str, Any]:
        """A server's own stats (engine counters, backend, process CPU seconds): of `url`, default the first."""
        await self.start()
        upstream = next((u for u in self._pool.upstreams if url in (None, u.url)), None)
        if upstream is None:
            raise ValueError(f"{url!r} is not one of this RemoteEngine's servers: {self.config.url}")
        conn = upstream.conn
        if conn is None:
            raise EngineError(f"not connected to {upstream.url}")
        return await self._thread.run(conn.server_stats())

    async def aclose(self) -> None:
        """End every open call with EngineClosedError, close the sockets and the thread. Cannot be restarted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        await thread.stop(self._shutdown)

    # ---------------------------------------------------------------- options
    def check_options(
        self,
        voice: str | None = None,
        sampling: SamplingOverrides | None = None,
        *,
        adapter: str | None = None,
        **overrides: float | int | None,
    ) -> SpeechOptions:
        """The voice, adapter and sampling a request would use, checked locally against what the servers accept;
        TypeError/ValueError naming what is wrong."""
        terms = self._terms
        # A voice the server maps to an adapter needs no adapter here: the server picks it (None travels).
        return SpeechOptions.check(
            terms.spec, terms.sampling, voice, sampling, adapter, terms.adapters, None, **overrides
        )

    def sentences(self, text: str) -> list[str]:
        """The sentences `synthesize(text)` speaks, in order, as the server splits them (`AudioChunk.utterance`)."""
        return split_sentences(text, self._terms.sentence_max_chars)

    # ---------------------------------------------------------------- synthesis
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
    ) -> Speech:
        """Speak `text` on a server: a `Speech` as OrpheusEngine.synthesize returns it (validated eagerly; text over
        the server's `--max-chars`, which its hello names, is a ValueError at once).

        The server fills in its own sampling defaults: only the overrides travel; `speed` is stretched by the server's
        engine. Leaving the loop early,
        `aclose()` or cancelling the task sends `cancel` at once. `speculative`: as OrpheusEngine's; its
        `Speech.confirm()` reaches the server, which counts it (not a server behind Ray Serve's proxy: its streams
        are posted, and their replicas cannot hear of a confirm).
        """
        check_text_length(text, self._terms.max_chars, "the server's", remedy=" (serve --max-chars)")
        if not isinstance(speculative, bool):
            raise TypeError(f"speculative must be a bool, got {type(speculative).__name__}")
        options = SpeechOptions.chosen(options, self.check_options, voice, sampling, adapter, **overrides)
        sentences = self.sentences(text)
        request = protocol.Start(text, options.voice, options.overrides, options.adapter, options.speed, speculative)
        speculation = self._speculations.open() if speculative else None
        return Speech(sentences, self._synthesize(request, speculation), speculation)

    async def _synthesize(
        self, request: protocol.Start, speculation: Speculation | None
    ) -> AsyncGenerator[AudioChunk, None]:
        if self._closed:
            raise EngineClosedError("RemoteEngine is closed")
        await self.start()
        stream = CallerStream(asyncio.get_running_loop(), request, speculation)
        if speculation is not None:
            speculation.listen(lambda settled: self._tell_server(stream, settled))
            speculation.started()
        self._thread.call(self._router.begin, stream)
        self._counters.count("streams_started")
        outcome = "streams_cancelled"
        received = 0
        try:
            while True:
                try:
                    chunk = await stream.box.get()
                except StopAsyncIteration:
                    outcome = "streams_completed"
                    return
                if chunk.final:
                    outcome = "streams_completed"
                received += chunk.num_samples
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
            self._counters.count(outcome)
            if speculation is not None:
                if outcome != "streams_completed":
                    speculation.discard()
                speculation.released()
                speculation.ended(received / SAMPLE_RATE)
            if outcome == "streams_cancelled":
                stream.closed = True
                with contextlib.suppress(RuntimeError):  # the connection's loop is gone: nothing to cancel
                    self._thread.call(self._router.cancel, stream)

    # ---------------------------------------------------------------- the connection's loop
    def _tell_server(self, stream: CallerStream, outcome: str) -> None:
        """Any thread: `stream`'s speculation settled; its server hears of it on the connection's loop."""
        with contextlib.suppress(RuntimeError):  # the connection's loop is gone, and the server's streams with it
            self._thread.call(self._router.settle, stream, outcome)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("RemoteEngine is closed")
            if self._thread is not None:
                return
            self._thread = LoopThread("orpheus-remote")
            booted = self._thread.start(self._boot, lambda: None)
        booted.result()  # at once: the boot only starts tasks

    async def _boot(self) -> None:
        self._pool.boot()

    def _adopt(self, conn: Connection) -> None:
        """A new connection: take the server's voices and sampling defaults (the pool then lets waiting callers in)."""
        self._terms.adopt(conn.hello, self._pool.listed_voices())
        self._counters.count("connects")

    def _take_listed_voices(self) -> None:
        """A server's new status: the voices the servers list now (cloned ones come and go) into `spec`."""
        self._terms.take_voices(self._pool.listed_voices())

    async def _shutdown(self) -> None:
        """Stop reconnecting and close every connection, within about CLOSE_TIMEOUT_S whatever the servers do: a
        dead, stopped or unreachable server holds nothing open here (aclose() must not hang on it)."""
        await self._pool.aclose()
        self._router.close()
