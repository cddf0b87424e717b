"""A base for backends that forward requests to another engine: request counters, continuations, the pumped stream.

A pumped stream's engine has no per-request pause, so a pause aborts the request there and a resume submits its
continuation (the prompt plus every id delivered so far).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Any

from ..config import SEED_LIMIT
from ..runtime.mailbox import Mailbox
from .protocol import BackendError, FinishReason, GenerationRequest

log = logging.getLogger(__name__)


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

    def _observe(self, out: Any) -> None:
        """Each output of the other engine, before its ids are read (nothing here; a subclass may count)."""

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
                self._observe(out)
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
