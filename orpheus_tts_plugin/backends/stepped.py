"""A base for in-process backends: one thread steps a batch of requests, delivering each step's ids to the loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from typing import Any

from ..runtime.mailbox import Mailbox
from .protocol import BackendError, FinishReason, GenerationRequest, check_loop


class _StepStream:
    """A TokenStream fed by a stepping thread; lives on the loop that called `generate`."""

    def __init__(self, backend: SteppedBackend, req: GenerationRequest):
        self.req = req
        self.finish_reason: str | None = None
        self._backend = backend
        self._box: Mailbox[list[int]] = Mailbox()
        self._closed = False

    def __aiter__(self) -> _StepStream:
        return self

    async def __anext__(self) -> list[int]:
        return await self._box.get()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._box.ended:
                self._backend._abort(self)
                self._box.end()

    def pause(self, paused: bool) -> None:
        self._backend._pause(self, paused)

    def _push(self, ids: list[int], finish: str | None, error: BaseException | None = None) -> None:
        """Called on the loop once per engine step with this request's new ids."""
        if self._closed:
            return
        if ids:
            self._box.put(ids)
        if finish is not None:
            self.finish_reason = finish
            self._box.end(error)


class _Waiting:
    """Requests waiting for a batch row: continuations of streams already speaking first, each in arrival order."""

    def __init__(self) -> None:
        self._first: collections.deque[_StepStream] = collections.deque()
        self._rest: collections.deque[_StepStream] = collections.deque()

    def push(self, stream: _StepStream) -> None:
        (self._first if stream.req.priority else self._rest).append(stream)

    def pop(self) -> _StepStream:
        return (self._first or self._rest).popleft()

    def remove(self, stream: _StepStream) -> bool:
        for queue in (self._first, self._rest):
            if stream in queue:
                queue.remove(stream)
                return True
        return False

    def drain(self) -> list[_StepStream]:
        out = [*self._first, *self._rest]
        self._first.clear()
        self._rest.clear()
        return out

    def __len__(self) -> int:
        return len(self._first) + len(self._rest)


class SteppedBackend:
    """Base of in-process backends: one thread runs engine steps over every live request.

    Subclasses implement `_load`, `_admit`, `_step` and `_release`; this class owns the thread,
    admission, aborts (honoured before the next step) and delivery of each step's ids to the
    event loop in one `call_soon_threadsafe` per step, never one per token. If the stepping thread
    dies, every live and waiting request ends with a BackendError and `failure` says why.
    """

    name = "stepped"

    def __init__(self, max_batch_size: int = 64):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self._cv = threading.Condition()
        self._pending = _Waiting()  # under _cv
        self._aborts: set[_StepStream] = set()
        self._paused: set[_StepStream] = set()  # under _cv: requests that sit out steps (their consumer is behind)
        self._live: dict[_StepStream, Any] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        self._step_count = 0
        self._abort_requested_at: dict[_StepStream, int] = {}
        self._counters: collections.Counter[str] = collections.Counter()
        self._max_steps_to_abort = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None  # why the stepping thread died, if it did

    # -- subclass hooks (run on the stepping thread) --
    def _load(self) -> None:
        """Load the model; runs once on the stepping thread before the first step."""

    def _admit(self, req: GenerationRequest) -> Any:
        """Start a request (prefill); return its per-request state."""
        raise NotImplementedError

    def _step(self, states: list[Any]) -> list[tuple[list[int], str | None]]:
        """Advance every state one engine step: its new ids and finish reason (or None)."""
        raise NotImplementedError

    def _release(self, state: Any) -> None:
        """Free a request's resources (KV cache slot)."""

    def _idle_wait(self) -> float | None:
        """Seconds the stepping thread may sleep when no request is live (None: until woken)."""
        return None

    # -- protocol --
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = self._loop.create_future()
        self._running = True

        def run() -> None:
            try:
                self._load()
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                self._running = False
                self._loop.call_soon_threadsafe(_set_exception, ready, exc)
                return
            self._loop.call_soon_threadsafe(_set_result, ready)
            try:
                self._run()
            except BaseException as exc:  # noqa: BLE001 - no request may wait on a dead thread
                self._die(exc)
            finally:
                for stream in list(self._live):
                    self._drop(stream)

        self._thread = threading.Thread(target=run, name=f"orpheus-{self.name}-steps", daemon=True)
        self._thread.start()
        await ready

    def generate(self, req: GenerationRequest) -> _StepStream:
        if self.failure is not None:
            raise BackendError(f"{self.name} backend failed: {self.failure}")
        check_loop(self._loop if self._running else None, self.name)
        stream = _StepStream(self, req)
        with self._cv:
            self._pending.push(stream)
            self._cv.notify()
        return stream

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {
                "backend": self.name,
                "live_requests": len(self._live),
                "queued_requests": len(self._pending),
                "paused_requests": len(self._paused),
                "steps": self._step_count,
                "max_steps_to_abort": self._max_steps_to_abort,
                "failure": self.failure,
                **self._counters,
            }

    async def close(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- internals --
    def _abort(self, stream: _StepStream) -> None:
        with self._cv:
            self._aborts.add(stream)
            self._paused.discard(stream)
            self._abort_requested_at[stream] = self._step_count
            self._cv.notify()

    def _pause(self, stream: _StepStream, paused: bool) -> None:
        with self._cv:
            if paused:
                self._paused.add(stream)
            else:
                self._paused.discard(stream)
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._running and self._idle():
                    self._cv.wait(self._idle_wait())
                if not self._running:
                    break
                paused = set(self._paused)
                aborts, self._aborts = self._aborts, set()
                admit: list[_StepStream] = []
                while self._pending and len(self._live) + len(admit) < self.max_batch_size:
                    admit.append(self._pending.pop())
                for stream in aborts:
                    requested = self._abort_requested_at.pop(stream, self._step_count)
                    self._max_steps_to_abort = max(self._max_steps_to_abort, self._step_count - requested)
            for stream in aborts:
                if stream in admit:
                    admit.remove(stream)
                elif not self._drop(stream):
                    with self._cv:
                        if not self._pending.remove(stream):
                            continue
                self._counters["aborted"] += 1
            results: list[tuple[_StepStream, list[int], str | None, BaseException | None]] = []
            for stream in admit:
                try:
                    self._live[stream] = self._admit(stream.req)
                    self._counters["admitted"] += 1
                except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
                    results.append((stream, [], FinishReason.ERROR, BackendError(str(exc))))
            streams = [s for s in self._live if s not in paused]
            if streams:
                try:
                    outs = self._step([self._live[s] for s in streams])
                except Exception as exc:  # noqa: BLE001 - fail every live request, keep serving
                    outs = [([], FinishReason.ERROR)] * len(streams)
                    error: BaseException | None = BackendError(f"{self.name} step failed: {exc}")
                else:
                    error = None
                with self._cv:
                    self._step_count += 1
                for stream, (ids, finish) in zip(streams, outs):
                    if finish is not None:
                        self._drop(stream)
                        self._counters[f"finish_{finish}"] += 1
                    results.append((stream, ids, finish, error if finish == FinishReason.ERROR else None))
                    self._counters["tokens"] += len(ids)
            if results:
                self._loop.call_soon_threadsafe(_dispatch, results)

    def _idle(self) -> bool:
        """Under the lock: nothing to abort, admit or step (every live request paused, or none live)."""
        admittable = self._pending and len(self._live) < self.max_batch_size
        return not (self._aborts or admittable or not self._live.keys() <= self._paused)

    def _die(self, exc: BaseException) -> None:
        """The stepping thread is going: end every live and waiting request with an error (stepping thread)."""
        with self._cv:
            self.failure = f"stepping thread died: {type(exc).__name__}: {exc}"
            self._running = False
            streams = [*self._live, *self._pending.drain()]
        error = BackendError(f"{self.name} backend failed: {self.failure}")
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(_dispatch, [(s, [], FinishReason.ERROR, error) for s in streams])

    def _drop(self, stream: _StepStream) -> bool:
        """Release a live request's state; False if it was not live."""
        state = self._live.pop(stream, None)
        with self._cv:
            self._paused.discard(stream)
        if state is None:
            return False
        self._release(state)
        return True


def _dispatch(results: list[tuple[_StepStream, list[int], str | None, BaseException | None]]) -> None:
    for stream, ids, finish, error in results:
        stream._push(ids, finish, error)


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
