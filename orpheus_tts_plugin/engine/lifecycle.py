"""The engine's life: started once (by whichever caller comes first), healthy or failed, closed for good.

`Lifecycle` owns the engine loop's thread and what its start loaded (tokenizer, backend, decode worker);
a dead engine thread fails the engine (`_fail`), which ends every open stream at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ..errors import EngineClosedError, EngineError, EngineFailedError
from ..runtime.loop_thread import LoopThread
from .decode_worker import DecodeWorker
from .loading import load

if TYPE_CHECKING:
    from ..backends.protocol import TokenBackend
    from ..codec.decoder import FrameDecoder

log = logging.getLogger(__name__)


def _failed(fut: concurrent.futures.Future[None]) -> bool:
    """Whether a done future ended without a result (an exception, or cancelled), without raising either."""
    return fut.cancelled() or fut.exception() is not None


class Lifecycle:
    """`OrpheusEngine`'s start, health, failure and close (a mixin: the engine's lock guards its flags)."""

    def _init_lifecycle(self, backend: TokenBackend | None, decoder: FrameDecoder | None) -> None:
        self._custom_backend = backend
        self._custom_decoder = decoder
        self._started: concurrent.futures.Future[None] | None = None  # under _lock
        self._thread: LoopThread | None = None  # the engine loop's thread of the latest start
        self._backend: TokenBackend | None = None  # engine loop only, once started
        self._worker: DecodeWorker | None = None
        self._tokenizer: Any = None
        self._closed = False  # under _lock
        self._failure: str | None = None  # under _lock

    def prewarm(self) -> None:
        """Start loading in the background and return at once (from any thread, with or without an event loop)."""
        self._begin_start()

    def _begin_start(self) -> concurrent.futures.Future[None]:
        """The shared load's future: the one under way or done, or a new one if none began or the last failed."""
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            if self._started is not None and self._started.done() and _failed(self._started):
                self._started = None  # a load that failed may be tried again (the files fixed, the GPU freed)
            if self._started is None:
                self._thread = LoopThread("orpheus-engine")
                self._started = self._thread.start(self._boot, self._loop_stopped)
            return self._started

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        """The engine loop of the latest start (None before the first)."""
        return None if self._thread is None else self._thread.loop

    async def start(self) -> None:
        """Load the tokenizer, backend and decoder once; safe to await from any loop, any number of times.

        Cancelling a caller (a job that ends while the engine loads, a `wait_for`, Ctrl-C) never cancels
        the shared load: it goes on for every other caller and the next `start()`.
        """
        try:
            await asyncio.shield(asyncio.wrap_future(self._begin_start()))
        except EngineError as exc:  # the same error for every caller: do not let its traceback grow with each one
            raise exc.with_traceback(None) from exc.__cause__
        health = self.health()
        if health["status"] == "failed":
            raise EngineFailedError(f"engine failed: {health['reason']}")

    @property
    def started(self) -> bool:
        started = self._started
        return started is not None and started.done() and not _failed(started)

    @property
    def ready(self) -> bool:
        """Started, not closed, not failed: new streams will be served."""
        return self.health()["status"] == "ok"

    def health(self) -> dict[str, Any]:
        """{"status": "not started" | "starting" | "ok" | "failed" | "closed", "reason": why, if not ok}."""
        with self._lock:
            closed, failure, started = self._closed, self._failure, self._started
        if failure is None and self._backend is not None:
            failure = getattr(self._backend, "failure", None)
        if closed:
            return {"status": "closed", "reason": "aclose() was called"}
        if failure is not None:
            return {"status": "failed", "reason": failure}
        if started is None:
            return {"status": "not started", "reason": "start() or prewarm() not called yet"}
        if not started.done():
            return {"status": "starting", "reason": "loading"}
        if _failed(started):
            why = "interrupted" if started.cancelled() else started.exception()
            return {"status": "failed", "reason": f"start failed: {why}"}
        return {"status": "ok", "reason": None}

    def _loop_stopped(self) -> None:
        if not self._closed:
            self._fail("the engine loop stopped")

    async def _boot(self) -> None:
        """Load everything on the engine loop (every start() caller gets a failure itself)."""
        try:
            parts = await load(self.config, self.spec, backend=self._custom_backend, decoder=self._custom_decoder)
        except BaseException as exc:
            log.debug("Orpheus engine failed to start: %s", exc)
            raise
        self._tokenizer, self._backend = parts.tokenizer, parts.backend
        self._snac = getattr(parts.decoder, "snac", None)
        await asyncio.to_thread(self._voices.encode_all, self._tokenizer, self._encoder)
        self._worker = DecodeWorker(
            parts.decoder, self._stream_done, self._stream_failed, self._decoder_died, self.config.decode_ahead_s
        )

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
            await asyncio.shield(asyncio.wrap_future(started))
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - a failed start leaves nothing to stop
            return
        await self._thread.stop(self._shutdown)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._backend.close()
        await asyncio.to_thread(self._worker.close)
        self._end_all(EngineClosedError("engine closed"))

    def _fail(self, reason: str) -> None:
        """An engine thread is gone: fail every open stream now and refuse new ones (any thread)."""
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = reason
        log.error("Orpheus engine failed: %s", reason)
        orphans = self._end_all(EngineFailedError(f"engine failed: {reason}"))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._cancel_generations, orphans)

    def _decoder_died(self, exc: BaseException) -> None:
        self._fail(f"the decoder thread died: {type(exc).__name__}: {exc}")
