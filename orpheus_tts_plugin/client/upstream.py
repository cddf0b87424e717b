"""The servers of a RemoteEngine: each one's connection, kept up by itself, and the choice of where a new stream goes.

A server is left for new streams the moment its connection drops (until it says hello again), and once its pushed
`status` says it drains or its engine does not serve (the server checks its status every `app.STATUS_INTERVAL_S`).
A server behind Ray Serve's proxy keeps no connection: after its hello, its streams are posted
(`stream_posts.PostedConnection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..errors import EngineError, KeyRefusedError
from ..wire import protocol
from ..wire.routing import least_loaded
from .connection import Connection, Deliver, endpoint

if TYPE_CHECKING:
    from .stream_posts import PostedConnection, StreamPosts

# Opens one connection to a URL, with the status and close callbacks of its Upstream.
Connect = Callable[[str, Callable[[dict[str, Any]], None], Callable[[str], None]], Awaitable[Connection]]


def server_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """The URLs of one URL, of a comma-separated list of them, or of a sequence of either; ValueError for a
    malformed one or none (a comma inside a URL must be written %2C)."""
    items = [urls] if isinstance(urls, str) else list(urls)
    if not all(isinstance(item, str) for item in items):
        raise TypeError(f"url must be a str or a sequence of str, got {urls!r}")
    out = tuple(part.strip() for item in items for part in item.split(",") if part.strip())
    if not out:
        raise ValueError(f"url must name at least one server, got {urls!r}")
    for url in out:
        endpoint(url)  # a malformed URL fails here, not in the background
    return out


def http_base(url: str) -> str | None:
    """http(s)://HOST:PORT[/PREFIX] of a server's URL (PREFIX: what comes before its WebSocket path, e.g. a Ray
    Serve route prefix); None for a Unix socket."""
    uri, path = endpoint(url)
    if path is not None:
        return None
    parts = urlsplit(uri)
    prefix = parts.path[: -len(protocol.WS_PATH)] if parts.path.endswith(protocol.WS_PATH) else ""
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}{prefix}"


class Upstream:
    """One server of a RemoteEngine: its connection (re-opened with its own jittered backoff), its last status,
    and this client's streams started on it since that status (which the status cannot count yet).

    Everything here belongs to the RemoteEngine's connection loop; other threads only read references.
    """

    def __init__(
        self,
        url: str,
        connect: Connect,
        backoff_s: tuple[float, float],
        on_up: Callable[[Upstream, Connection], None],
        posts_options: tuple[Any, ...] = (None, None, 5.0),
        on_refused: Callable[[Upstream], None] | None = None,
        on_status: Callable[[], None] | None = None,
    ):
        """`posts_options`: StreamPosts' (ssl, api_key, connect_timeout_s[, silence_s]), for a server that asks for
        posts; `on_refused`: called when the server refuses the key (waiting for it is then pointless); `on_status`:
        called after each new status (pushed, or polled from behind a proxy)."""
        self.url = url
        self.conn: Connection | PostedConnection | None = None  # None while not connected
        self.status: dict[str, Any] = {}  # the server's last `status` message
        self.last_error: str | None = None  # why the last connection attempt failed or the connection closed
        self.connects = 0
        self.key_refused = False  # its last connection attempt was refused for the key (`last_error` says why)
        self._on_refused = on_refused
        self._connect = connect
        self._backoff = backoff_s
        self._on_up = on_up  # called with each new connection, once it is this Upstream's
        self._on_new_status = on_status
        self._unreported: set[int] = set()  # ids (on `conn`) of open streams started since the last status
        self._posts_base = http_base(url)  # None for a Unix socket: streams then stay on the WebSocket
        self._posts_options = posts_options
        self._posts: StreamPosts | None = None  # made at the first hello that asks for posts
        self._orphan: Connection | PostedConnection | None = None  # opened as stop() came (never adopted)
        self._stopping = asyncio.Event()  # set once by stop(): keep_connected returns, whatever it was awaiting

    async def keep_connected(self) -> None:
        """Connect, serve until the socket closes, reconnect with jittered exponential backoff; until stop().

        It checks `stop()`'s flag after every await rather than relying on cancellation alone: Python 3.11's
        `asyncio.wait_for` drops a cancel that arrives as its awaitable finishes (a refused connect returns at
        once), and the loop then went on reconnecting for ever, hanging `RemoteEngine.aclose()`.
        """
        first, longest = self._backoff
        delay = first
        while not self._stopping.is_set():
            try:
                conn = await self._connect(self.url, self._on_status, self._on_close)
                if conn.hello.streams_path is not None and self._posts_base is not None:
                    conn = await self._posted(conn)
            except EngineError as exc:
                self.last_error = str(exc)
                self.key_refused = isinstance(exc, KeyRefusedError)
                if self.key_refused and self._on_refused is not None:
                    self._on_refused(self)
                with contextlib.suppress(asyncio.TimeoutError):  # the backoff, cut short by stop()
                    await asyncio.wait_for(self._stopping.wait(), delay * random.uniform(0.8, 1.2))
                delay = min(2 * delay, longest)
                continue
            if self._stopping.is_set():  # connected as stop() came: not adopted, closed by the caller of stop()
                self._orphan = conn
                return
            delay = first
            self.key_refused = False
            self.status, self.conn = conn.status, conn
            self._unreported.clear()
            self.connects += 1
            self._on_up(self, conn)
            await asyncio.shield(conn.closed)  # a cancel must not cancel the connection's own future

    async def _posted(self, conn: Connection) -> PostedConnection:
        """A server behind a proxy: its hello's WebSocket closed (a replica would count it as an open request for
        its whole life), its streams posted from now on. EngineError if the server did not serve when it said
        hello (no status reaches a posting client: it says hello again after its backoff)."""
        from .stream_posts import PostedConnection, StreamPosts  # aiohttp: only for servers that ask for it

        await conn.aclose(notify=False)
        status = conn.status.get("status", "ok")
        if status != "ok" or conn.status.get("draining"):
            raise EngineError(f"{self.url} does not serve yet: {status}: {conn.status.get('reason') or 'draining'}")
        if self._posts is None:
            self._posts = StreamPosts(self._posts_base, *self._posts_options)
        return PostedConnection(self.url, conn.hello, conn.status, self._posts, self._on_close, self._on_status)

    def stop(self) -> None:
        """Stop reconnecting: keep_connected returns at its next step (its owner also cancels it, to end the step
        it is in); the open connection stays for the owner to close: `connections()` lists it."""
        self._stopping.set()

    def connections(self) -> list[Connection | PostedConnection]:
        """Its connections: the current one, and one that opened as stop() came."""
        return [c for c in (self.conn, self._orphan) if c is not None]

    # ---------------------------------------------------------------- what it can take
    @property
    def usable(self) -> bool:
        """Connected, and its last status says its engine serves and it is not draining."""
        return self.conn is not None and self.status.get("status", "ok") == "ok" and not self.status.get("draining")

    @property
    def load(self) -> float:
        """The server's load as it last said it; 1.0 (nothing to spare) while not usable."""
        return float(self.status.get("load", 0.0)) if self.usable else 1.0

    def expected_load(self) -> float:
        """Its last pushed load plus this client's streams started on it since then, as a fraction of its capacity."""
        max_streams = self.conn.hello.max_streams if self.conn is not None else 1
        return float(self.status.get("load", 0.0)) + len(self._unreported) / max(1, max_streams)

    # ---------------------------------------------------------------- streams
    def start(self, request: protocol.Start, deliver: Deliver) -> tuple[Connection | PostedConnection, int]:
        """Start a stream on the current connection (which must be up): (that connection, the stream id).

        A server whose hello names `streams_path` (behind Ray Serve's proxy) gets it as an HTTP request of its
        own (`PostedConnection`), which the proxy routes by itself.
        """
        conn = self.conn
        if conn is None:
            raise EngineError(f"not connected to {self.url}")
        sid = conn.start(request, deliver)
        self._unreported.add(sid)
        return conn, sid

    def posts_stats(self) -> dict[str, Any]:
        """For a server behind Ray Serve: streams started by replica (`replicas`) and HTTP connections opened
        (`http_connects`); {} otherwise."""
        if self._posts is None:
            return {}
        return {"replicas": dict(self._posts.replicas), "http_connects": self._posts.connects}

    def cancel(self, conn: Connection | PostedConnection, sid: int) -> None:
        """Abort a stream started on `conn`."""
        self.ended(conn, sid)
        conn.cancel(sid)

    def ended(self, conn: Connection | PostedConnection, sid: int) -> None:
        """A stream of `conn` ended (or was cancelled): no longer counted on top of the status."""
        if conn is self.conn:
            self._unreported.discard(sid)

    async def aclose(self, error: BaseException) -> None:
        """Close its connections and end its posted streams with `error` (after stop())."""
        closing = [c.aclose(error) for c in self.connections()]
        if self._posts is not None:
            closing.append(self._posts.aclose(error))
        await asyncio.gather(*closing)

    def _on_status(self, message: dict[str, Any]) -> None:
        self.status = message
        self._unreported.clear()
        if self._on_new_status is not None:
            self._on_new_status()

    def _on_close(self, reason: str) -> None:
        """The connection closed: forget it before any of its streams hears of it (choose() skips it at once)."""
        self.last_error = reason
        self.conn = None
        self._unreported.clear()


def choose(upstreams: Sequence[Upstream], turn: int) -> Upstream | None:
    """Where a new stream goes (`routing.least_loaded`): the usable server with the least expected load, ties
    round-robin from `turn`.

    With none usable, the least loaded connected one (its own refusal, e.g. "draining", then says why);
    None when none is connected.
    """
    connected = [u for u in upstreams if u.conn is not None]
    candidates = [u for u in connected if u.usable] or connected
    if not candidates:
        return None
    return least_loaded(candidates, Upstream.expected_load, turn)
