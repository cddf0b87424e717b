"""The token backend protocol, and a base for backends that step a batch of requests in a thread."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from ..config import SEED_LIMIT, SamplingParams
from ..mailbox import Mailbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt token ids in, audio token ids out, at most `max_new_tokens`."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    constrain_audio: bool = True
    priority: bool = False  # a continuation of a stream that is already speaking: served before new requests


class FinishReason:
    """Why a generation ended."""

    STOP = "stop"  # the model emitted the end-of-speech id
    LENGTH = "length"  # max_new_tokens reached
    ABORTED = "aborted"  # the consumer closed the stream
    ERROR = "error"


@runtime_checkable
class TokenStream(Protocol):
    """New token ids of one request, as the backend produces them."""

    finish_reason: str | None

    def __aiter__(self) -> AsyncIterator[Sequence[int]]: ...

    async def __anext__(self) -> Sequence[int]: ...

    async def aclose(self) -> None:
        """Abort the request in the backend within one engine step."""


@runtime_checkable
class PausableStream(Protocol):
    """A TokenStream whose generation can stop while its consumer is behind, and go on where it stopped."""

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) generating: a stepped row keeps its KV cache, a pumped request is redone."""


@runtime_checkable
class TokenBackend(Protocol):
    """Token generation behind one small protocol; knows nothing about audio."""

    async def start(self) -> None: ...

    def generate(self, req: GenerationRequest) -> TokenStream: ...

    def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class BackendError(RuntimeError):
    """The backend failed a request (the model crashed, the server went away)."""


def check_loop(started_on: asyncio.AbstractEventLoop | None, name: str) -> None:
    """BackendError unless the backend was started, and on the running loop (its streams live on that loop)."""
    if started_on is None:
        raise BackendError(f"{name} backend is not started")
    if asyncio.get_running_loop() is not started_on:
        raise BackendError(f"{name} backend: generate() must run on the loop that started it")


class RequestCounts:
    """Live requests and outcome counters of a backend that forwards requests to another engine.

    `pausable`: its streams pause (PumpedStream), so `paused_requests` (now) and `pauses` / `resumes` (so far).
    """

    def __init__(self, *extra: str, pausable: bool = False):
        self.live = 0
        self.paused = 0
        self.pausable = pausable
        pauses = ("pauses", "resumes") if pausable else ()
        self.counts: collections.Counter[str] = collections.Counter(
            {key: 0 for key in ("requests", "tokens", *extra, *pauses, "aborted", "errors")}
        )

    def started(self) -> None:
        self.counts["requests"] += 1
        self.live += 1

    def add_tokens(self, n: int) -> None:
        self.counts["tokens"] += n

    def failed_to_start(self) -> None:
        """A request the other engine refused before it began."""
        self.counts["errors"] += 1

    def pause(self) -> None:
        """A live request stopped generating for a consumer that is behind."""
        self.paused += 1
        self.counts["pauses"] += 1

    def resume(self) -> None:
        """A paused request goes on generating."""
        self.paused -= 1
        self.counts["resumes"] += 1

    def ended(self, reason: str, *, paused: bool = False) -> None:
        """A request ended (`paused`: while it was paused)."""
        self.live -= 1
        if paused:
            self.paused -= 1
        if reason == FinishReason.ABORTED:
            self.counts["aborted"] += 1
        elif reason == FinishReason.ERROR:
            self.counts["errors"] += 1

    def stats(self, name: str, **extra: Any) -> dict[str, Any]:
        paused = {"paused_requests": self.paused} if self.pausable else {}
        return {"backend": name, **extra, "live_requests": self.live, **paused, **self.counts}


# 2**64 / golden ratio, odd (splitmix64's step): continuation seeds land far from the next sentence's (the engine
# seeds sentence i with seed + i) and from each other's.
CONTINUATION_SEED_STRIDE = 0x9E37_79B9_7F4A_7C15


def continuation_seed(seed: int | None, n: int) -> int | None:
    """The seed of a request's n-th continuation: derived from its own, so a seeded stream that paused still repeats."""
    return None if seed is None else (seed + n * CONTINUATION_SEED_STRIDE) % SEED_LIMIT


def continuation(req: GenerationRequest, generated: Sequence[int], n: int) -> GenerationRequest:
    """The n-th resubmission of `req` after a pause: the ids generated so far join its prompt and leave its budget."""
    return replace(
        req,
        request_id=f"{req.request_id}~{n}",
        prompt_ids=(*req.prompt_ids, *generated),
        max_new_tokens=req.max_new_tokens - len(generated),
        sampling=replace(req.sampling, seed=continuation_seed(req.sampling.seed, n)),
        priority=True,  # it is already speaking
    )


class PumpedStream:
    """A TokenStream fed by a task that reads another engine's per-step outputs into a mailbox (loop that made it).

    For engines whose outputs carry `.finished` and `.outputs[0]` (TensorRT-LLM, vLLM). Subclasses say where a
    step's new ids are (`_new_ids`), how to abort (`_abort`) and how to resubmit (`_resubmit`); `aclose()` ends the
    stream at once whatever the other engine then does, and the final output's trailing stop id is never delivered.

    Pausing: these engines have no per-request pause, so `pause(True)` stops the pump and aborts the request there
    (its row and KV blocks are freed), and `pause(False)` submits its `continuation`: prompt + every id delivered so
    far, the rest of the token budget, the audio constraint going on at the next frame position, request id
    `{id}~{n}`. The consumer sees one request, no id lost or repeated; `stats()` counts it once. The other engine's
    generator starts afresh, so a seeded continuation draws with `continuation_seed(seed, n)`: a seeded stream that
    paused repeats itself but differs from one that did not (a greedy one does not differ).
    """

    name = "pumped"
    finish_reasons: dict[str, str] = {}  # the other engine's finish reasons → FinishReason

    def __init__(self, req: GenerationRequest, outputs: Any, stop_ids: Sequence[int], counts: RequestCounts):
        self.req = req
        self.attempt = req  # the request in the other engine (or last there): `req` or its latest continuation
        self.finish_reason: str | None = None
        self._counts = counts
        self._stop = frozenset(stop_ids)
        self._box: Mailbox[list[int]] = Mailbox()
        self._sent: list[int] = []  # every id delivered, over every attempt: a continuation's prompt tail
        self._paused = False
        self._resumes = 0
        self._resuming: asyncio.Handle | None = None  # the resubmission due at the loop's next turn
        self._stopping: asyncio.Task[None] | None = None  # the abort of the attempt that a pause stopped
        self._loop = asyncio.get_running_loop()
        self._pump = self._loop.create_task(self._run(outputs))

    @property
    def generated(self) -> int:
        """Ids delivered so far: the output index at which a resumed request goes on."""
        return len(self._sent)

    def _new_ids(self, completion: Any) -> list[int]:
        """The ids one step added."""
        raise NotImplementedError

    def _abort(self) -> Awaitable[None] | None:
        """Abort `attempt` in the other engine, starting now; what is left of that to await, if anything."""
        raise NotImplementedError

    def _resubmit(self, req: GenerationRequest, audio_offset: int) -> Any:
        """Submit a continuation whose audio constraint starts at output index `audio_offset`; its outputs."""
        raise NotImplementedError

    def __aiter__(self) -> PumpedStream:
        return self

    async def __anext__(self) -> list[int]:
        return await self._box.get()

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) generating, as the class docstring says; nothing once finished or unchanged."""
        if self.finish_reason is not None or paused == self._paused:
            return
        self._paused = paused
        if not paused:
            self._counts.resume()
            # At the loop's next turn, so that a pause ending because the stream closes (the engine's `finally`
            # resumes, then closes) resubmits nothing.
            self._resuming = self._loop.call_soon(self._resubmit_now)
            return
        self._counts.pause()
        if self._resuming is not None:  # resumed and paused again within one turn: nothing was resubmitted
            self._resuming.cancel()
            self._resuming = None
            return
        self._pump.cancel()
        self._stopping = self._abort_now()

    async def aclose(self) -> None:
        """End the stream now, stop the pump and abort the request in the other engine (if one is there)."""
        if self.finish_reason is not None:
            return
        running = not self._paused and self._resuming is None  # else a pause has aborted it already
        if self._resuming is not None:
            self._resuming.cancel()
            self._resuming = None
        self._finish(FinishReason.ABORTED)
        self._box.clear()
        self._pump.cancel()
        stopping = self._abort_now() if running else self._stopping
        if stopping is not None and not stopping.done():
            await asyncio.shield(stopping)  # the abort completes even if this caller is cancelled

    def _resubmit_now(self) -> None:
        """Submit the continuation and pump its outputs; the stream ends if it cannot be submitted."""
        self._resuming = None
        if self.finish_reason is not None or self._paused:
            return
        if len(self._sent) >= self.req.max_new_tokens:  # the budget ran out just as the pause came
            self._finish(FinishReason.LENGTH)
            return
        self._resumes += 1
        self.attempt = continuation(self.req, self._sent, self._resumes)
        try:
            outputs = self._resubmit(self.attempt, len(self._sent))
        except Exception as exc:  # noqa: BLE001 - reported to the consumer
            self._finish(FinishReason.ERROR, BackendError(f"{self.name} could not resume {self.req.request_id}: {exc}"))
            return
        self._pump = self._loop.create_task(self._run(outputs))

    def _abort_now(self) -> asyncio.Task[None] | None:
        """Abort `attempt`: its synchronous part now, the rest in a task (None if nothing is left of it)."""
        rid = self.attempt.request_id
        try:
            pending = self._abort()
        except Exception:  # noqa: BLE001 - the request may have finished, or the engine shut down, meanwhile
            log.debug("%s abort of %s failed", self.name, rid, exc_info=True)
            return None
        return None if pending is None else self._loop.create_task(self._settle_abort(pending, rid))

    async def _settle_abort(self, pending: Awaitable[None], rid: str) -> None:
        """Await an abort, logging rather than raising its failure (the request may have ended meanwhile)."""
        try:
            await pending
        except Exception:  # noqa: BLE001 - as in _abort_now
            log.debug("%s abort of %s failed", self.name, rid, exc_info=True)

    async def _run(self, outputs: Any) -> None:
        try:
            async for out in outputs:
                completion = out.outputs[0]
                ids = list(self._new_ids(completion))
                if out.finished:
                    if ids and ids[-1] in self._stop:
                        ids.pop()
                    self._push(ids, self.finish_reasons.get(completion.finish_reason, FinishReason.ERROR))
                    return
                self._push(ids, None)
            self._push([], FinishReason.ERROR)  # ended without a finished output
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the consumer
            error = BackendError(f"{self.name} request {self.req.request_id} failed: {exc}")
            self._push([], FinishReason.ERROR, error)

    def _push(self, ids: list[int], finish: str | None, error: BaseException | None = None) -> None:
        if self.finish_reason is not None:  # closed meanwhile
            return
        if ids:
            self._sent.extend(ids)
            self._box.put(ids)
            self._counts.add_tokens(len(ids))
        if finish is not None:
            self._finish(finish, error)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.finish_reason = reason
        self._counts.ended(reason, paused=self._paused)
        self._box.end(error)


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
