"""The client half of `POST protocol.STREAMS_PATH`: each stream one HTTP request over a pool of kept-alive
connections, on the loop that owns it (a RemoteEngine's connection loop).

Used when a server's hello names `streams_path`: a proxy in front (Ray Serve's) then routes each stream by itself
to the least-loaded replica, where a WebSocket would be routed once and pin every stream to one replica. The
WebSocket that brought the hello is closed at once (`PostedConnection` stands for it): held open, a replica would
count it as an open request for its whole life, which Ray routes, scales and drains on. A stream that ends whole
gives its connection back to the pool; a cancelled one closes its connection, which the proxy and the server see as
the client gone (the engine stream is aborted).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import ssl as ssl_module
from collections.abc import Callable
from typing import Any

from ..errors import EngineError, EngineOverloadedError, missing_extra
from ..wire import protocol
from .connection import Deliver

try:
    import aiohttp
except ImportError as exc:
    raise missing_extra("server", "RemoteEngine behind Ray Serve", exc) from None


RETRIES = 3  # tries of a stream refused at capacity before its first audio
RETRY_S = 0.05  # the wait before the second try (doubled for the next)
POLL_S = 2.0  # how often a posting client asks the proxy for a replica's load (one GET; also its keepalive)
SILENCE_S = 10.0  # a stream that hears nothing this long is lost (an engine admits or refuses at once, never queues)


class StreamPosts:
    """Streams as HTTP requests to one base URL; every method runs on the loop that created it."""

    def __init__(
        self,
        base_url: str,
        ssl: ssl_module.SSLContext | None,
        api_key: str | None,
        connect_timeout_s: float,
        silence_s: float | None = SILENCE_S,
    ):
        """`silence_s`: a stream that hears nothing for this long ends with EngineError (a hung proxy or replica:
        no socket is held to ping; None: wait for ever)."""
        self.base_url = base_url  # http(s)://HOST:PORT, without a path
        self._ssl = ssl
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=silence_s)
        self._session: aiohttp.ClientSession | None = None  # the streams' pool, made at the first one, on this loop
        self._control: aiohttp.ClientSession | None = None  # one connection for GETs (stats), apart from the streams'
        self._tasks: dict[int, tuple[asyncio.Task[None], Deliver]] = {}  # live streams by id
        self._ids = itertools.count()
        self.replicas: collections.Counter[str] = collections.Counter()  # streams started, by replica that served
        self.connects = 0  # connections opened (a cancelled stream's is closed; a finished one's is reused)
        self.on_unreachable: Callable[[str], None] | None = None  # called when a stream cannot connect at all

    def start(self, path: str, request: protocol.Start, deliver: Deliver) -> int:
        """POST `request` to `path`; `deliver` then gets its chunks and its end. Returns the stream's id."""
        self._ensure_session()
        sid = next(self._ids)
        self._tasks[sid] = (asyncio.create_task(self._run(sid, self.base_url + path, request, deliver)), deliver)
        return sid

    async def get_json(self, path: str, timeout_s: float) -> Any:
        """GET base_url + path (e.g. /stats, through the proxy: one replica's answer), its JSON body, over a connection
        of its own (the streams' pool and its count stay theirs)."""
        if self._control is None:
            self._control = self._new_session(limit=1)
        url = self.base_url + path
        try:
            async with self._control.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise EngineError(f"{url} answered HTTP {resp.status}")
                return await resp.json()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise self._failed(exc, f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc

    def _ensure_session(self) -> None:
        if self._session is None:
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(self._connected)
            self._session = self._new_session(limit=0, timeout=self._timeout, trace_configs=[trace])

    def _new_session(self, limit: int, **options: Any) -> aiohttp.ClientSession:
        """A session of at most `limit` connections (0: no limit) with this client's TLS and key."""
        connector = aiohttp.TCPConnector(limit=limit, ssl=self._ssl if self._ssl is not None else True)
        return aiohttp.ClientSession(connector=connector, headers=self._headers, **options)

    def _failed(self, exc: BaseException, message: str) -> EngineError:
        """The EngineError `message`; where nothing answered at the address at all, on_unreachable hears it first
        (the hello is out of date too)."""
        error = EngineError(message)
        if isinstance(exc, aiohttp.ClientConnectorError) and self.on_unreachable is not None:
            self.on_unreachable(message)
        return error

    async def _connected(self, *_: Any) -> None:
        self.connects += 1

    def __contains__(self, sid: int) -> bool:
        return sid in self._tasks

    def cancel(self, sid: int) -> None:
        """Abort a stream: its connection closes (the server stops its work); nothing more reaches its deliver."""
        task, _ = self._tasks.pop(sid, (None, None))
        if task is not None:
            task.cancel()

    async def aclose(self, error: BaseException) -> None:
        """End every open stream with `error` and close the pool."""
        live, self._tasks = self._tasks, {}
        for task, deliver in live.values():
            task.cancel()
            deliver(error)
        await asyncio.gather(*(task for task, _ in live.values()), return_exceptions=True)
        for session in (self._session, self._control):
            if session is not None:
                await session.close()

    async def _run(self, sid: int, url: str, request: protocol.Start, deliver: Deliver) -> None:
        """One stream, from the POST to its end; a cancel (cancel(), aclose()) delivers nothing more.

        A refusal at capacity before any audio is retried (RETRIES times): the proxy routes on its own count of
        open requests, which does not know a replica's max_streams, and the next try goes to the least loaded of
        two replicas again."""
        try:
            for attempt in range(RETRIES):
                item, heard = await self._read(url, request, deliver)
                if heard or not isinstance(item, EngineOverloadedError) or attempt == RETRIES - 1:
                    break
                await asyncio.sleep(RETRY_S * 2**attempt)  # a replica that just started may not be routed to yet
        except (aiohttp.ClientError, asyncio.IncompleteReadError, OSError, asyncio.TimeoutError) as exc:
            item = self._failed(exc, f"connection to {url} lost ({type(exc).__name__}: {exc})")
        except (ValueError, KeyError) as exc:  # a broken frame: the stream ends, never hangs
            item = EngineError(f"bad message from {url}: {exc!r}")
        self._tasks.pop(sid, None)
        deliver(item)

    async def _read(self, url: str, request: protocol.Start, deliver: Deliver) -> tuple[Any, bool]:
        """Stream the response's audio to `deliver`; (what ends it: the final chunk, None or the error, whether
        any audio came)."""
        async with self._session.post(url, data=protocol.encode(request.message(0))) as resp:
            self.replicas[resp.headers.get(protocol.REPLICA_HEADER, "?")] += 1
            try:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    cls = EngineOverloadedError if resp.status in (429, 503) else EngineError
                    return cls(f"{url} answered HTTP {resp.status}: {text}"), False
                samples = 0
                while True:
                    length, kind = protocol.FRAME.unpack(await resp.content.readexactly(protocol.FRAME.size))
                    payload = await resp.content.readexactly(length)
                    if kind == protocol.FRAME_AUDIO:
                        chunk = protocol.parse_audio(payload, samples)
                        samples += chunk.num_samples
                        if not chunk.final:
                            deliver(chunk)
                            continue
                        end: Any = chunk
                    else:
                        message = protocol.decode(payload.decode())
                        end = None if message["type"] == "end" else protocol.exception(message)
                    await resp.read()  # the body's end: read, the connection goes back to the pool
                    return end, samples > 0
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    resp.close()  # not given back to the pool: closing it is the cancel
                raise


class PostedConnection:
    """A server behind a proxy once its hello is in, in a `Connection`'s place: streams go as posts and no socket is
    held. Every POLL_S it asks the proxy for a replica's stats: their `load` (a replica's, which the router keeps
    level with the others') is the server's load, and their `voices` its voices. `closed` resolves when a stream or
    that poll finds nothing answering at the address (its owner then says hello again, with backoff). Every method
    runs on the loop of `posts`."""

    def __init__(
        self,
        url: str,
        hello: protocol.Hello,
        status: dict[str, Any],
        posts: StreamPosts,
        on_close: Callable[[str], None] | None = None,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ):
        """`on_close(reason)`: called once, as `closed` resolves and before the stream that found out hears of it;
        `on_status(status)`: with the hello's status, its `load` replaced by each poll's."""
        assert hello.streams_path is not None
        self.url = url
        self.hello = hello
        self.status = status  # the status sent with the hello: a proxy's replicas push nothing to a posting client
        self._posts = posts
        self._path = hello.streams_path
        self._on_close = on_close
        self._on_status = on_status
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # result: why it closed
        posts.on_unreachable = self._lost
        self._poller = asyncio.create_task(self._poll(), name="orpheus-remote-poll")

    def start(self, request: protocol.Start, deliver: Deliver) -> int:
        """Post a stream; `deliver` gets its chunks and its end. Returns its id."""
        if self.closed.done():
            raise EngineError(f"connection to {self.url} is closed")
        return self._posts.start(self._path, request, deliver)

    def cancel(self, sid: int) -> None:
        """Abort a posted stream (its HTTP connection closes)."""
        self._posts.cancel(sid)

    def confirm(self, sid: int) -> None:
        """Nothing to send: a posted stream's replica cannot hear of it, so it does not count speculation (the
        RemoteEngine's own stats do)."""

    async def server_stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The stats of the replica the proxy sends this GET to."""
        return await self._posts.get_json("/stats", timeout_s)

    async def aclose(self, error: BaseException | None = None) -> None:
        """Done with: `closed` resolves (the posted streams belong to their StreamPosts, closed by its owner)."""
        self._lost(str(error or f"connection to {self.url} closed"))

    async def _poll(self) -> None:
        """The replicas' load, every POLL_S, until closed (a GET that cannot connect closes it)."""
        while not self.closed.done():
            await asyncio.sleep(POLL_S)
            try:
                stats = await self._posts.get_json("/stats", POLL_S)
            except EngineError:  # no replica to answer for now, or the proxy gone (then closed already)
                continue
            if "load" in stats and not self.closed.done():
                self.status = {**self.status, "load": float(stats["load"])}
                if "voices" in stats:  # cloned voices come and go; every replica lists the deployment's
                    self.status["voices"] = list(stats["voices"])
                if self._on_status is not None:
                    self._on_status(self.status)

    def _lost(self, reason: str) -> None:
        if not self.closed.done():
            self._poller.cancel()
            self.closed.set_result(reason)
            if self._on_close is not None:
                self._on_close(reason)
