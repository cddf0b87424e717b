"""A RemoteEngine's servers as one pool: an `Upstream` (and its connection) per server, the tasks that keep each one
connected, waiting until enough of them are (`start()`), what they say of themselves together, and closing them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import EngineClosedError, EngineError, KeyRefusedError
from .connection import CLOSE_TIMEOUT_S, Connection
from .settings import ConnectOptions, RemoteConfig
from .upstream import Upstream

SETTLE_POLL_S = 0.01  # start(): how often it looks whether the servers not yet connected have failed once
SETTLE_S = 0.5  # start(): how long, after the first server answered, the others have to answer too


class ServerPool:
    """The servers of one RemoteEngine, each kept connected by a task of its own on the connection's loop.

    Everything here belongs to the connection's loop (other threads only read the references).
    """

    def __init__(
        self,
        config: RemoteConfig,
        options: ConnectOptions,
        closed: Callable[[], bool],
        on_up: Callable[[Connection], None],
        on_status: Callable[[], None],
    ):
        """`closed`: whether the engine was closed (any thread sets it); `on_up`: called with each new connection
        before waiting callers are let in; `on_status`: called after each new status of any server."""
        self.url = config.url
        self._closed = closed
        self._on_up = on_up
        posts = options.posts_options()
        self.upstreams = tuple(
            Upstream(
                url,
                options.connect,
                options.backoff_s,
                self._up,
                posts,
                on_refused=lambda _: self._connected.set(),
                on_status=on_status,
            )
            for url in config.urls
        )
        # Set at each new connection, each refused key and at shutdown: waiters look again.
        self._connected = asyncio.Event()
        self._keepers: list[asyncio.Task[None]] = []
        self._waiters: set[asyncio.Task[Any]] = set()  # start()s waiting for a connection
        self._spread_once = False  # a start() has seen every server answer (or waited SETTLE_S for them)

    def boot(self) -> None:
        """Start keeping every server connected (on the connection's loop)."""
        self._keepers = [asyncio.create_task(u.keep_connected()) for u in self.upstreams]

    def _up(self, upstream: Upstream, conn: Connection) -> None:
        self._on_up(conn)
        self._connected.set()

    # ---------------------------------------------------------------- what they say together
    def reached(self, every_server: bool) -> bool:
        """Connected to a server (to every one, if `every_server`)."""
        connected = (u.conn is not None for u in self.upstreams)
        return all(connected) if every_server else any(connected)

    def spread(self, every_server: bool) -> bool:
        """`reached`, and every server has connected or failed at least once (a burst then sees them all), or a
        `wait_up` has seen that once."""
        settled = all(u.conn is not None or u.last_error is not None for u in self.upstreams)
        return self.reached(every_server) and (settled or self._spread_once)

    @property
    def usable(self) -> bool:
        """Connected to a server whose engine serves new streams."""
        return any(u.usable for u in self.upstreams)

    @property
    def load(self) -> float:
        """The servers' mean load; one not usable counts as full."""
        return sum(u.load for u in self.upstreams) / len(self.upstreams)

    def health(self) -> dict[str, Any]:
        """{"status", "reason"} once connecting: "ok" while any server serves; otherwise what the first connected
        server says of itself ("starting" while none is connected)."""
        connected = [u for u in self.upstreams if u.conn is not None]
        if not connected:
            return {"status": "starting", "reason": f"connecting to {self.url}: {self.why_down('...')}"}
        best = next((u for u in connected if u.status.get("status", "ok") == "ok"), connected[0])
        status = best.status.get("status", "ok")
        reason = best.status.get("reason")
        if len(self.upstreams) > 1 and status != "ok":
            reason = f"{best.url}: {reason}"
        return {"status": status, "reason": None if status == "ok" else reason}

    def why_down(self, unknown: str) -> str:
        """Why the servers not connected are not (`unknown` for one that has not failed yet)."""
        down = [u for u in self.upstreams if u.conn is None]
        if len(self.upstreams) == 1:
            return down[0].last_error or unknown if down else unknown
        return "; ".join(f"{u.url}: {u.last_error or unknown}" for u in down) or unknown

    def listed_voices(self) -> list[Sequence[str]]:
        """The voices each connected server's latest `status` listed, of those that listed any."""
        return [u.status["voices"] for u in self.upstreams if u.conn is not None and "voices" in u.status]

    def _key_refusal(self, every_server: bool) -> str | None:
        """Why waiting for a connection is pointless: each server it waits for refused the key (None: any may still
        answer)."""
        if self.reached(every_server):
            return None
        refused = [u for u in self.upstreams if u.conn is None and u.key_refused]
        if not refused or not (every_server or len(refused) == len(self.upstreams)):
            return None
        return "; ".join(dict.fromkeys(str(u.last_error) for u in refused))

    # ---------------------------------------------------------------- waiting and closing
    async def wait_up(self, timeout_s: float, every_server: bool) -> None:
        """Wait until `spread(every_server)`, or until `reached` and the others were given SETTLE_S; EngineError
        naming the servers not reached within `timeout_s`, KeyRefusedError at once if each refused the key."""
        waiter = asyncio.current_task()
        self._waiters.add(waiter)  # aclose lets it see `closed` before the loop stops: its caller gets an answer
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not self.spread(every_server) and not self._closed():
                refused = self._key_refusal(every_server)
                if refused is not None:
                    raise KeyRefusedError(refused)
                if self.reached(every_server):  # the others get a short while to answer, then are left to retry
                    deadline = min(deadline, loop.time() + SETTLE_S)
                    if loop.time() >= deadline:
                        break
                self._connected.clear()
                # A failed attempt sets no event: look again soon while some server has not answered yet.
                wait = deadline - loop.time() if not self.reached(every_server) else SETTLE_POLL_S
                try:
                    await asyncio.wait_for(self._connected.wait(), max(0.0, min(wait, deadline - loop.time())))
                except asyncio.TimeoutError:
                    if self.reached(every_server):
                        continue
                    unreached = ",".join(u.url for u in self.upstreams if u.conn is None) if every_server else None
                    where, why = unreached or self.url, self.why_down("no answer")
                    raise EngineError(f"cannot reach {where} within {timeout_s:g} s: {why}") from None
            if self._closed():
                raise EngineClosedError("RemoteEngine is closed")
            self._spread_once = True
        finally:
            self._waiters.discard(waiter)

    async def aclose(self) -> None:
        """Stop reconnecting and close every connection (their streams end with EngineClosedError), within about
        CLOSE_TIMEOUT_S whatever the servers do; then let waiting `wait_up`s see `closed` (after the engine's
        aclose() set it)."""
        for upstream in self.upstreams:
            upstream.stop()
        for keeper in self._keepers:
            keeper.cancel()
        if self._keepers:  # each returns at its next step if not at once
            await asyncio.wait(self._keepers, timeout=CLOSE_TIMEOUT_S)
        await asyncio.gather(*(u.aclose(EngineClosedError("RemoteEngine closed")) for u in self.upstreams))
        self._connected.set()
        if self._waiters:
            await asyncio.wait(self._waiters, timeout=CLOSE_TIMEOUT_S)
