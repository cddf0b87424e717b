"""`RemoteEngine`: OrpheusEngine's interface over one persistent WebSocket to each of its `orpheus-tts serve` servers
(behind Ray Serve's proxy: a hello, then an HTTP request per stream, `stream_posts`).

Threads: the connections live on the RemoteEngine's own event loop in one daemon thread (started by
`start()` or `prewarm()`). Callers on any loop in any thread hand requests to it with
`call_soon_threadsafe` and get their chunks back the same way, batched: one call per caller loop per
turn of the connection's loop. So, like OrpheusEngine, one RemoteEngine (one socket per server) serves
every caller of a process. Create it in the process that uses it: its thread does not survive a fork.
With several servers, each new stream goes to the least-loaded one that serves (`upstream.choose`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import ssl as ssl_module
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..config import MAX_TEXT_CHARS, EngineConfig, SamplingOverrides, SamplingParams, check_text_length
from ..errors import EngineClosedError, EngineError, EngineOverloadedError, KeyRefusedError
from ..runtime.loop_thread import LoopThread, Outbox, SharedInstances
from ..runtime.mailbox import Mailbox
from ..spec import SAMPLE_RATE, SPECS, ModelSpec, spec_for
from ..speculation import CONFIRMED, Speculation, SpeculationTally
from ..speech.text import split_sentences
from ..types import AudioChunk, Speech, SpeechOptions
from ..wire import protocol
from .connection import API_KEY_ENV, CLOSE_TIMEOUT_S, Connection, Item, to_mailbox
from .upstream import Upstream, choose, server_urls

if TYPE_CHECKING:
    from .stream_posts import PostedConnection

SETTLE_POLL_S = 0.01  # start(): how often it looks whether the servers not yet connected have failed once
SETTLE_S = 0.5  # start(): how long, after the first server answered, the others have to answer too
FAILOVER_POLL_S = 0.05  # a stream whose server was lost looks this often for another, until its deadline


@dataclass(frozen=True)
class RemoteConfig:
    """Where a RemoteEngine connects and the model it names: what adapters read as `engine.config`."""

    url: str  # its server, or its servers' URLs joined by commas
    model: str | None = None  # a label only (adapters show it); the server decides what it runs
    model_family: str = "orpheus-en"
    backend: str = "serve"

    @property
    def urls(self) -> tuple[str, ...]:
        """Each server's URL, in the order given."""
        return server_urls(self.url)


class _CallerStream:
    """One synthesize() call: created on the caller's loop; `box` is read there only."""

    __slots__ = (
        "_to_box",
        "box",
        "closed",
        "conn",
        "deadline",
        "heard",
        "loop",
        "request",
        "sid",
        "speculation",
        "tried",
        "upstream",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, request: protocol.Start, speculation: Speculation | None):
        self.loop = loop
        self.request = request
        self.speculation = speculation  # a speculative stream's outcome (any thread: its own lock)
        self.box: Mailbox[AudioChunk] = Mailbox()
        self._to_box = to_mailbox(self.box)  # caller's loop only
        self.closed = False  # set by the caller when it leaves early; read on the connection's loop
        # The rest belongs to the connection's loop.
        self.upstream: Upstream | None = None  # the server it went to
        self.conn: Connection | PostedConnection | None = None
        self.sid: int | None = None  # None while it waits for a server to go to
        self.heard = False  # some audio of it has come: it can go nowhere else now
        self.tried: list[Connection | PostedConnection] = []  # connections lost under it before its first audio
        self.deadline = 0.0  # the connection loop's time after which it goes to no other server

    def put(self, item: Item) -> None:
        """Runs on the caller's loop: hand `item` on, unless the caller already left."""
        if not self.closed:
            self._to_box(item)


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
        urls = server_urls(url)
        self.config = RemoteConfig(",".join(urls), model, model_family)
        # Replaced at each hello and each status that lists voices (the connection's loop writes).
        self.spec: ModelSpec = spec_for(model_family)
        self.sampling = SamplingParams()  # the server's defaults, replaced at each hello
        self.adapters: tuple[str, ...] = ()  # the server's LoRA adapters, replaced at each hello
        self._sentence_max_chars = EngineConfig().sentence_max_chars  # the server's, replaced at each hello
        self._max_chars = MAX_TEXT_CHARS  # characters a request may have: the server's, replaced at each hello
        self._ssl = ssl
        self._api_key = api_key  # None: Connection.open takes $ORPHEUS_API_KEY
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._lock = threading.Lock()  # guards _thread, _closed, _counters
        self._thread: LoopThread | None = None  # the connection's loop, from the first start() or prewarm()
        self._closed = False
        self._counters: collections.Counter[str] = collections.Counter()
        self._speculations = SpeculationTally()  # this process's speculative streams (any thread: its own lock)
        # The rest belongs to the connection's loop (other threads only read the references).
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        posts = (ssl, key, connect_timeout_s) if keepalive_s is not None else (ssl, key, connect_timeout_s, None)
        self._upstreams = tuple(
            Upstream(
                u,
                self._connect,
                backoff_s,
                self._adopt,
                posts,
                on_refused=lambda _: self._connected.set(),
                on_status=self._take_pushed_voices,
            )
            for u in urls
        )
        self._turn = 0  # round-robin among equally loaded servers
        self._open: set[_CallerStream] = set()
        # Set at each new connection, each refused key and at shutdown: waiters look again.
        self._connected = asyncio.Event()
        self._keepers: list[asyncio.Task[None]] = []
        self._waiters: set[asyncio.Task[Any]] = set()  # start()s waiting for a connection
        self._spread_once = False  # a start() has seen every server answer (or waited SETTLE_S for them)
        self._outbox: Outbox[_CallerStream] = Outbox()  # the connection's loop only

    @classmethod
    def shared(cls, url: str | Sequence[str], **options: Any) -> RemoteEngine:
        """The process-wide RemoteEngine for `url` (one socket per server for the whole process); `options`
        apply on creation."""
        joined = ",".join(server_urls(url))
        key = (os.getpid(), RemoteConfig(joined, options.get("model"), options.get("model_family", "orpheus-en")))
        return cls._shared.get(key, lambda: cls(joined, **options))

    # ---------------------------------------------------------------- lifecycle
    def prewarm(self) -> None:
        """Start connecting in the background and return at once (from any thread)."""
        self._ensure_thread()

    async def start(self, *, every_server: bool = False) -> None:
        """Wait until connected to a server (to each, if `every_server`), up to `connect_timeout_s`; EngineError
        naming the servers that cannot be reached. With several servers it also waits, within that time, until
        each has connected or failed once, so that a burst of streams right after it spreads over them all."""
        self._ensure_thread()
        if not (self._reached(every_server) and (self._settled() or self._spread_once)):
            await self._thread.run(self._wait_up(self._connect_timeout_s, every_server))

    @property
    def started(self) -> bool:
        """Connected now (to one server at least)."""
        return self._reached(False)

    @property
    def ready(self) -> bool:
        """Connected to a server whose engine serves new streams (not loading, failed or draining)."""
        return not self._closed and any(u.usable for u in self._upstreams)

    def health(self) -> dict[str, Any]:
        """{"status": "not started" | "starting" (connecting) | "ok" | "failed" | "closed", "reason"}: "ok" while
        any server serves; otherwise what the first connected server says of itself."""
        if self._closed:
            return {"status": "closed", "reason": "aclose() was called"}
        if self._thread is None:
            return {"status": "not started", "reason": "start() or prewarm() not called yet"}
        connected = [u for u in self._upstreams if u.conn is not None]
        if not connected:
            return {"status": "starting", "reason": f"connecting to {self.config.url}: {self._why_down('...')}"}
        best = next((u for u in connected if u.status.get("status", "ok") == "ok"), connected[0])
        status = best.status.get("status", "ok")
        reason = best.status.get("reason")
        if len(self._upstreams) > 1 and status != "ok":
            reason = f"{best.url}: {reason}"
        return {"status": status, "reason": None if status == "ok" else reason}

    @property
    def load(self) -> float:
        """The servers' mean load (fraction of max_streams in use); a server not connected, draining or not
        serving counts as full (1.0: it can take no call)."""
        return sum(u.load for u in self._upstreams) / len(self._upstreams)

    def stats(self) -> dict[str, Any]:
        """This process's streams (active_streams, started, completed, cancelled, failed, rejected), connects,
        failovers (streams sent on to another server, theirs lost before their first audio), and each server's last
        status (`servers`, by URL; with one URL also `server`); `await server_stats()` has a server's own counters.
        Its `speculative_*` count this process's speculative streams as OrpheusEngine's do, with the audio received
        (not generated) and the time open as their cost."""
        with self._lock:
            counters = dict(self._counters)
        streams = collections.Counter(s.upstream.url for s in list(self._open) if s.upstream is not None)
        servers = {
            u.url: {
                "connected": u.conn is not None,
                "load": u.load,
                "active_streams": streams[u.url],
                "connects": u.connects,
                "last_error": u.last_error,
                "status": dict(u.status),
                **u.posts_stats(),
            }
            for u in self._upstreams
        }
        out = {
            "active_streams": len(self._open),
            **counters,
            "connected": self.started,
            "load": self.load,
            "status": self.health()["status"],
            "servers": servers,
            **self._speculations.stats(),
        }
        if len(self._upstreams) == 1:
            out["server"] = dict(self._upstreams[0].status)
        return out

    async def server_stats(self, url: str | None = None) -> dict[str, Any]:
        """A server's own stats (engine counters, backend, process CPU seconds): of `url`, default the first."""
        await self.start()
        upstream = next((u for u in self._upstreams if url in (None, u.url)), None)
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
        # A voice the server maps to an adapter needs no adapter here: the server picks it (None travels).
        return SpeechOptions.check(self.spec, self.sampling, voice, sampling, adapter, self.adapters, None, **overrides)

    def sentences(self, text: str) -> list[str]:
        """The sentences `synthesize(text)` speaks, in order, as the server splits them (`AudioChunk.utterance`)."""
        return split_sentences(text, self._sentence_max_chars)

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
        check_text_length(text, self._max_chars, "the server's", remedy=" (serve --max-chars)")
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
        stream = _CallerStream(asyncio.get_running_loop(), request, speculation)
        if speculation is not None:
            speculation.listen(lambda settled: self._tell_server(stream, settled))
            speculation.started()
        self._thread.call(self._begin, stream)
        self._count("streams_started")
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
            self._count(outcome)
            if speculation is not None:
                if outcome != "streams_completed":
                    speculation.discard()
                speculation.released()
                speculation.ended(received / SAMPLE_RATE)
            if outcome == "streams_cancelled":
                stream.closed = True
                with contextlib.suppress(RuntimeError):  # the connection's loop is gone: nothing to cancel
                    self._thread.call(self._cancel, stream)

    def _count(self, key: str) -> None:
        with self._lock:
            self._counters[key] += 1

    def _settled(self) -> bool:
        """Every server has connected or failed at least once (a burst then sees them all)."""
        return all(u.conn is not None or u.last_error is not None for u in self._upstreams)

    def _reached(self, every_server: bool) -> bool:
        """Connected to a server (to every one, if `every_server`)."""
        connected = (u.conn is not None for u in self._upstreams)
        return all(connected) if every_server else any(connected)

    def _key_refusal(self, every_server: bool) -> str | None:
        """Why waiting for a connection is pointless: each server it waits for refused the key (None: any may still
        answer)."""
        if self._reached(every_server):
            return None
        refused = [u for u in self._upstreams if u.conn is None and u.key_refused]
        if not refused or not (every_server or len(refused) == len(self._upstreams)):
            return None
        return "; ".join(dict.fromkeys(str(u.last_error) for u in refused))

    def _why_down(self, unknown: str) -> str:
        """Why the servers not connected are not (`unknown` for one that has not failed yet)."""
        down = [u for u in self._upstreams if u.conn is None]
        if len(self._upstreams) == 1:
            return down[0].last_error or unknown if down else unknown
        return "; ".join(f"{u.url}: {u.last_error or unknown}" for u in down) or unknown

    # ---------------------------------------------------------------- the connection's loop
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
        self._keepers = [asyncio.create_task(u.keep_connected()) for u in self._upstreams]

    def _post(self, stream: _CallerStream, item: Item) -> None:
        """Queue `item` for its caller's loop; what is queued in one turn of this loop goes in one call per loop."""
        if not self._outbox:
            self._thread.loop.call_soon(self._flush)
        self._outbox.add(stream, item)

    def _flush(self) -> None:
        for stream in self._outbox.send():  # its caller's loop is closed: nobody listens; stop the server's work
            stream.closed = True
            self._cancel(stream)

    async def _connect(
        self, url: str, on_status: Callable[[dict[str, Any]], None], on_close: Callable[[str], None]
    ) -> Connection:
        """One connection to `url` with this engine's TLS, key, timeout and keepalive (for its Upstream, whose
        `on_status` then brings the servers' voices (cloned ones come and go) into `spec`, on this loop)."""
        return await Connection.open(
            url,
            ssl=self._ssl,
            api_key=self._api_key,
            timeout_s=self._connect_timeout_s,
            keepalive_s=self._keepalive_s,
            on_status=on_status,
            on_close=on_close,
        )

    def _take_pushed_voices(self) -> None:
        """The voices the servers' latest `status` listed (cloned voices added since the hello; polled from behind
        a proxy), if any."""
        pushed = [u.status["voices"] for u in self._upstreams if u.conn is not None and "voices" in u.status]
        if pushed:
            voices = tuple(dict.fromkeys(v for listed in pushed for v in listed))
            if voices != self.spec.voices:
                self.spec = replace(self.spec, voices=voices)

    def _adopt(self, upstream: Upstream, conn: Connection) -> None:
        """A new connection: take the server's voices and sampling defaults, and let waiting callers in."""
        hello = conn.hello
        base = SPECS.get(hello.model_family) or ModelSpec(name=hello.model_family)
        self.spec = replace(base, voices=hello.voices, default_voice=hello.default_voice)
        self.sampling = hello.sampling
        self.adapters = hello.adapters
        self._sentence_max_chars = hello.sentence_max_chars
        self._max_chars = hello.max_chars
        self._take_pushed_voices()
        self._count("connects")
        self._connected.set()

    async def _wait_up(self, timeout_s: float, every_server: bool) -> None:
        waiter = asyncio.current_task()
        self._waiters.add(waiter)  # _shutdown lets it see _closed before the loop stops: its caller gets an answer
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not (self._reached(every_server) and (self._settled() or self._spread_once)) and not self._closed:
                refused = self._key_refusal(every_server)
                if refused is not None:
                    raise KeyRefusedError(refused)
                if self._reached(every_server):  # the others get a short while to answer, then are left to retry
                    deadline = min(deadline, loop.time() + SETTLE_S)
                    if loop.time() >= deadline:
                        break
                self._connected.clear()
                # A failed attempt sets no event: look again soon while some server has not answered yet.
                wait = deadline - loop.time() if not self._reached(every_server) else SETTLE_POLL_S
                try:
                    await asyncio.wait_for(self._connected.wait(), max(0.0, min(wait, deadline - loop.time())))
                except asyncio.TimeoutError:
                    if self._reached(every_server):
                        continue
                    unreached = ",".join(u.url for u in self._upstreams if u.conn is None) if every_server else None
                    where, why = unreached or self.config.url, self._why_down("no answer")
                    raise EngineError(f"cannot reach {where} within {timeout_s:g} s: {why}") from None
            if self._closed:
                raise EngineClosedError("RemoteEngine is closed")
            self._spread_once = True
        finally:
            self._waiters.discard(waiter)

    def _begin(self, stream: _CallerStream) -> None:
        stream.deadline = self._thread.loop.time() + self._connect_timeout_s
        self._route(stream, None)

    def _route(self, stream: _CallerStream, lost: EngineError | None) -> None:
        """Send `stream` to the least loaded server it has not been lost on; `lost`: why its last server was lost
        before its first audio (None: its first try). With none to go to, it fails at once on its first try; after
        a loss it waits for one to (re)connect until its deadline, then fails with `lost`."""
        if stream.closed:
            return
        fresh = [u for u in self._upstreams if u.conn is not None and u.conn not in stream.tried]
        upstream = choose(fresh, self._turn)
        self._turn += 1
        if upstream is None:
            loop = self._thread.loop
            if lost is None or self._closed or loop.time() >= stream.deadline:
                self._open.discard(stream)
                self._post(stream, lost or EngineError(f"connection to {self.config.url} lost: {self._why_down('')}"))
            else:
                loop.call_later(FAILOVER_POLL_S, self._route, stream, lost)
            return
        self._open.add(stream)
        stream.upstream = upstream
        request = stream.request
        if request.speculative and not upstream.conn.hello.speculation:  # a server that would refuse a confirm
            request = replace(request, speculative=False)
        stream.conn, stream.sid = upstream.start(request, lambda item: self._arrive(stream, item))
        if stream.speculation is not None and stream.speculation.outcome == CONFIRMED:  # confirmed before it began
            stream.conn.confirm(stream.sid)

    def _tell_server(self, stream: _CallerStream, outcome: str) -> None:
        """Any thread: `stream`'s speculation settled; its server hears of it on the connection's loop."""
        with contextlib.suppress(RuntimeError):  # the connection's loop is gone, and the server's streams with it
            self._thread.call(self._settle, stream, outcome)

    def _settle(self, stream: _CallerStream, outcome: str) -> None:
        """Send `confirm`, or the `cancel` that discards a stream that is over (once; not before it began: `_route`
        sends a confirm that came first, or while it waited for another server)."""
        if stream.conn is None or stream.sid is None:
            return
        if outcome == CONFIRMED:
            stream.conn.confirm(stream.sid)
        else:
            stream.conn.cancel(stream.sid)

    def _arrive(self, stream: _CallerStream, item: Item) -> None:
        if self._lost_before_audio(stream, item):
            stream.upstream.ended(stream.conn, stream.sid)
            stream.tried.append(stream.conn)
            stream.sid = None
            self._count("failovers")
            self._route(stream, item)
            return
        if isinstance(item, AudioChunk):
            stream.heard = True
        if not isinstance(item, AudioChunk) or item.final:
            self._open.discard(stream)
            stream.upstream.ended(stream.conn, stream.sid)
        self._post(stream, item)

    def _lost_before_audio(self, stream: _CallerStream, item: Item) -> bool:
        """`item` ends `stream` because its server was lost (its connection closed, or a post found nothing at the
        address) before any of its audio came, while it may still go elsewhere: nothing of it was heard, so it can."""
        return (
            type(item) is EngineError
            and not stream.heard
            and stream.conn is not None
            and stream.conn.closed.done()
            and not self._closed
            and self._thread.loop.time() < stream.deadline
        )

    def _cancel(self, stream: _CallerStream) -> None:
        self._open.discard(stream)
        if stream.upstream is not None and stream.sid is not None:
            stream.upstream.cancel(stream.conn, stream.sid)

    async def _shutdown(self) -> None:
        """Stop reconnecting and close every connection, within about CLOSE_TIMEOUT_S whatever the servers do: a
        dead, stopped or unreachable server holds nothing open here (aclose() must not hang on it)."""
        for upstream in self._upstreams:
            upstream.stop()
        for keeper in self._keepers:
            keeper.cancel()
        if self._keepers:  # each returns at its next step if not at once
            await asyncio.wait(self._keepers, timeout=CLOSE_TIMEOUT_S)
        await asyncio.gather(*(u.aclose(EngineClosedError("RemoteEngine closed")) for u in self._upstreams))
        self._connected.set()  # waiting callers see _closed
        if self._waiters:
            await asyncio.wait(self._waiters, timeout=CLOSE_TIMEOUT_S)
        for stream in [s for s in self._open if s.sid is None]:  # lost its server, waiting for another
            self._open.discard(stream)
            self._post(stream, EngineClosedError("RemoteEngine closed"))
        self._flush()
