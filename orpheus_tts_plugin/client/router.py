"""Where each stream of a RemoteEngine goes, on the connection's loop: to the least-loaded server that serves
(`upstream.choose`), on to another one if its server is lost before its first audio (failover), and what its server
sends back to its caller's loop (batched: one call per caller loop per turn of the connection's loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import EngineClosedError, EngineError
from ..runtime.loop_thread import Outbox
from ..runtime.mailbox import Mailbox
from ..speculation import CONFIRMED, Speculation
from ..types import AudioChunk
from ..wire import protocol
from .connection import Connection, Item, to_mailbox
from .pool import ServerPool
from .upstream import Upstream, choose

if TYPE_CHECKING:
    from .stream_posts import PostedConnection

FAILOVER_POLL_S = 0.05  # a stream whose server was lost looks this often for another, until its deadline


class CallerStream:
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


class Router:
    """The streams of one RemoteEngine from `begin` to their end. Every method runs on the connection's loop."""

    def __init__(self, pool: ServerPool, failover_s: float, closed: Callable[[], bool], count: Callable[[str], None]):
        """`failover_s`: how long after it began a stream lost before its first audio may go to another server;
        `closed`: whether the engine was closed (any thread sets it); `count`: counts each failover."""
        self._pool = pool
        self._failover_s = failover_s
        self._closed = closed
        self._count = count
        # The rest belongs to the connection's loop (other threads only read the references).
        self.open: set[CallerStream] = set()
        self._turn = 0  # round-robin among equally loaded servers
        self._outbox: Outbox[CallerStream] = Outbox()

    def begin(self, stream: CallerStream) -> None:
        stream.deadline = asyncio.get_running_loop().time() + self._failover_s
        self._route(stream, None)

    def _route(self, stream: CallerStream, lost: EngineError | None) -> None:
        """Send `stream` to the least loaded server it has not been lost on; `lost`: why its last server was lost
        before its first audio (None: its first try). With none to go to, it fails at once on its first try; after
        a loss it waits for one to (re)connect until its deadline, then fails with `lost`."""
        if stream.closed:
            return
        fresh = [u for u in self._pool.upstreams if u.conn is not None and u.conn not in stream.tried]
        upstream = choose(fresh, self._turn)
        self._turn += 1
        if upstream is None:
            loop = asyncio.get_running_loop()
            if lost is None or self._closed() or loop.time() >= stream.deadline:
                self.open.discard(stream)
                why = f"connection to {self._pool.url} lost: {self._pool.why_down('')}"
                self._post(stream, lost or EngineError(why))
            else:
                loop.call_later(FAILOVER_POLL_S, self._route, stream, lost)
            return
        self.open.add(stream)
        stream.upstream = upstream
        request = stream.request
        if request.speculative and not upstream.conn.hello.speculation:  # a server that would refuse a confirm
            request = replace(request, speculative=False)
        stream.conn, stream.sid = upstream.start(request, lambda item: self._arrive(stream, item))
        if stream.speculation is not None and stream.speculation.outcome == CONFIRMED:  # confirmed before it began
            stream.conn.confirm(stream.sid)

    def settle(self, stream: CallerStream, outcome: str) -> None:
        """Send `confirm`, or the `cancel` that discards a stream that is over (once; not before it began: `_route`
        sends a confirm that came first, or while it waited for another server)."""
        if stream.conn is None or stream.sid is None:
            return
        if outcome == CONFIRMED:
            stream.conn.confirm(stream.sid)
        else:
            stream.conn.cancel(stream.sid)

    def _arrive(self, stream: CallerStream, item: Item) -> None:
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
            self.open.discard(stream)
            stream.upstream.ended(stream.conn, stream.sid)
        self._post(stream, item)

    def _lost_before_audio(self, stream: CallerStream, item: Item) -> bool:
        """`item` ends `stream` because its server was lost (its connection closed, or a post found nothing at the
        address) before any of its audio came, while it may still go elsewhere: nothing of it was heard, so it can."""
        return (
            type(item) is EngineError
            and not stream.heard
            and stream.conn is not None
            and stream.conn.closed.done()
            and not self._closed()
            and asyncio.get_running_loop().time() < stream.deadline
        )

    def cancel(self, stream: CallerStream) -> None:
        self.open.discard(stream)
        if stream.upstream is not None and stream.sid is not None:
            stream.upstream.cancel(stream.conn, stream.sid)

    def close(self) -> None:
        """The engine closed: end the streams that lost their server and wait for another with EngineClosedError,
        and send what is queued now."""
        for stream in [s for s in self.open if s.sid is None]:
            self.open.discard(stream)
            self._post(stream, EngineClosedError("RemoteEngine closed"))
        self._flush()

    def _post(self, stream: CallerStream, item: Item) -> None:
        """Queue `item` for its caller's loop; what is queued in one turn of this loop goes in one call per loop."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.add(stream, item)

    def _flush(self) -> None:
        for stream in self._outbox.send():  # its caller's loop is closed: nobody listens; stop the server's work
            stream.closed = True
            self.cancel(stream)
