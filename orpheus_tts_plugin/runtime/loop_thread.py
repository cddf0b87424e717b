"""An event loop in a daemon thread, serving callers on other loops: what OrpheusEngine and RemoteEngine share.

`LoopThread` runs the loop and stops it; `Outbox` hands items to callers' loops, one `call_soon_threadsafe`
per caller loop per batch; `SharedInstances` keeps the one process-wide instance per key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from ..errors import EngineError
from .mailbox import Mailbox

log = logging.getLogger(__name__)

K = TypeVar("K")
T = TypeVar("T")


class LoopThread:
    """One asyncio event loop in one daemon thread, from `start` until `stop` (or until it dies)."""

    def __init__(self, name: str):
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the thread before its boot runs
        self._thread: threading.Thread | None = None

    def start(
        self, boot: Callable[[], Coroutine[Any, Any, None]], on_stopped: Callable[[], None]
    ) -> concurrent.futures.Future[None]:
        """Start the thread: its loop runs `boot()`, then runs until `stop`; the future resolves with `boot`.

        A failed boot closes the loop (its exception is the future's). `on_stopped` runs in the thread if the
        loop stops after a good boot, whether by `stop` or not.
        """
        booted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(boot, on_stopped, booted), name=self.name, daemon=True)
        self._thread.start()
        return booted

    def _main(
        self,
        boot: Callable[[], Coroutine[Any, Any, None]],
        on_stopped: Callable[[], None],
        booted: concurrent.futures.Future[None],
    ) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(boot())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the boot
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by someone else
                booted.set_exception(exc)
            loop.close()
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            booted.set_result(None)
        try:
            loop.run_forever()
        finally:
            on_stopped()
            loop.close()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon (from any thread); RuntimeError if the loop is closed."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` run on the loop, from a caller's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def stop(self, shutdown: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `shutdown()` on the loop, stop the loop, join the thread; a cancelled caller leaves nothing half done."""
        fut = asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
        await asyncio.shield(asyncio.wrap_future(fut))
        with contextlib.suppress(RuntimeError):  # `shutdown` may have stopped and closed it already
            self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join)


class Receiver(Protocol):
    """A caller's end of a stream: its loop, and what to do with an item there."""

    loop: asyncio.AbstractEventLoop
    box: Mailbox[Any]

    def put(self, item: Any) -> None: ...


R = TypeVar("R", bound=Receiver)


def _deliver(items: list[tuple[Receiver, Any]]) -> None:
    """Runs on a caller's loop: hand each item to its stream."""
    for stream, item in items:
        try:
            stream.put(item)
        except Exception as exc:  # noqa: BLE001 - one caller's failure must not stop delivery to the others
            stream.box.end(EngineError(f"delivery failed: {exc!r}"))


class Outbox(Generic[R]):
    """Items bound for callers' loops, gathered by one thread and sent as one call per caller loop."""

    def __init__(self) -> None:
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[R, Any]]] = {}  # the sending thread only

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, stream: R, item: Any) -> None:
        self._pending.setdefault(stream.loop, []).append((stream, item))

    def send(self) -> list[R]:
        """Send what was added; the streams whose caller's loop is closed (nobody listens to them any more)."""
        pending, self._pending = self._pending, {}
        gone: list[R] = []
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                gone += [stream for stream, _ in items]
        return gone


def post(stream: Receiver, item: Any) -> None:
    """Hand one item to a stream on its own loop, from any thread (dropped if that loop is closed)."""
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(_deliver, [(stream, item)])


class SharedInstances(Generic[K, T]):
    """The process-wide instance for each key: the one made before, or a new one if none was or it is closed."""

    def __init__(self, is_closed: Callable[[T], bool]):
        self._is_closed = is_closed
        self._items: dict[K, T] = {}  # under _lock
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], T]) -> T:
        with self._lock:
            item = self._items.get(key)
            if item is None or self._is_closed(item):
                item = self._items[key] = make()
            return item
