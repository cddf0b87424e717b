"""The hand-off from a producer to one consumer on one event loop: a deque and at most one waiter."""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items for one consumer: `put`/`end` run on the consumer's loop, `await get()` waits for the next.

    Cheaper than asyncio.Queue (no per-item futures, no size bookkeeping) on paths that carry
    every engine step of every stream.
    """

    __slots__ = ("_ended", "_error", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: BaseException | None = None

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, item: T) -> None:
        self._items.append(item)
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        """No more items: `get()` drains what is left, then raises `error` or StopAsyncIteration."""
        self._ended = True
        self._error = error
        self._wake()

    def clear(self) -> None:
        """Drop the items not yet taken."""
        self._items.clear()

    async def get(self) -> T:
        while not self._items:
            if self._ended:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
