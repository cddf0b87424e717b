"""What speculation costs: each speculative stream settled once, confirmed or discarded, and an engine's tally of them.

A speculative stream speaks a reply while the caller's turn is still being confirmed. `Speech.confirm()` says its
audio will be played; closed, cancelled or dropped before that, it was discarded. Whatever the order of the events
(the engine admits it, ends its generation, gives back its slot; the caller confirms or discards), it is counted
once, and a discarded one's engine work once.

Threads: every method may be called from any thread. `dropped` (a Speech's finalizer) only appends to a deque and
takes no lock, so a garbage collection that runs while some thread holds the lock cannot deadlock; the next call
on the tally settles it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

CONFIRMED, DISCARDED = "confirmed", "discarded"
STAT_KEYS = (
    "speculative_started",
    "speculative_confirmed",
    "speculative_discarded",
    "speculative_discarded_audio_s",  # audio seconds generated for discarded speculations: the work thrown away
    "speculative_discarded_open_s",  # stream-seconds discarded speculations held an engine slot
)


class Speculation:
    """One speculative stream. Its engine says `started()` (admitted), `released()` (its slot given back) and
    `ended(generated_s)` (generation over); its caller says `confirm()` or `discard()`: the first of those two wins.

    Every field is guarded by its tally's lock.
    """

    __slots__ = (
        "_charged",
        "_counted",
        "_ended_at",
        "_generated_s",
        "_listener",
        "_released_at",
        "_started_at",
        "_tally",
        "outcome",
    )

    def __init__(self, tally: SpeculationTally):
        self._tally = tally
        self.outcome: str | None = None  # CONFIRMED or DISCARDED once settled
        self._started_at: float | None = None  # monotonic time the engine admitted it
        self._released_at: float | None = None  # ... gave back its slot
        self._ended_at: float | None = None  # ... ended its generation
        self._generated_s = 0.0
        self._counted = False  # its outcome is in the tally
        self._charged = False  # its discarded work is in the tally
        self._listener: Callable[[str], None] | None = None

    def confirm(self) -> None:
        """Its audio will be played (a no-op once settled)."""
        self._tally.settle(self, CONFIRMED)

    def discard(self) -> None:
        """Its audio will not be played (a no-op once settled)."""
        self._tally.settle(self, DISCARDED)

    def dropped(self) -> None:
        """Its Speech was garbage-collected: discarded, settled at the tally's next call (safe in a finalizer)."""
        self._tally.dropped.append(self)

    def started(self) -> None:
        """The engine admitted it: counted as started."""
        self._tally.update(self, "_started_at")

    def released(self) -> None:
        """The engine gave back its slot (the first call counts)."""
        self._tally.update(self, "_released_at")

    def ended(self, generated_s: float) -> None:
        """Its generation is over, after `generated_s` seconds of audio (decoded or not, read or not)."""
        self._generated_s = generated_s
        self._tally.update(self, "_ended_at")

    def listen(self, callback: Callable[[str], None]) -> None:
        """Call `callback(outcome)` when it settles from now on (outside any lock, on the settling thread)."""
        with self._tally.lock:
            self._listener = callback


class SpeculationTally:
    """An engine's speculative streams: started, confirmed, discarded, and the work discarded ones cost (`stats`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dropped: collections.deque[Speculation] = collections.deque()  # appended without the lock: finalizers
        self._counts: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)

    def open(self) -> Speculation:
        """A new speculation, counted once the engine admits it (and those dropped since the last call settled)."""
        self._take_dropped()
        return Speculation(self)

    def stats(self) -> dict[str, float]:
        """STAT_KEYS: counts, and seconds rounded to the millisecond."""
        self._take_dropped()
        with self.lock:
            out = dict(self._counts)
        for key in STAT_KEYS[3:]:
            out[key] = round(out[key], 3)
        return out

    def settle(self, spec: Speculation, outcome: str) -> None:
        """Settle `spec` as `outcome` unless it already is."""
        self._take_dropped()
        self._settle(spec, outcome)

    def update(self, spec: Speculation, stamp: str) -> None:
        """Stamp an engine event of `spec` (once) and book what is now due."""
        self._take_dropped()
        with self.lock:
            if getattr(spec, stamp) is None:
                setattr(spec, stamp, time.monotonic())
                if stamp == "_started_at":
                    self._counts["speculative_started"] += 1
            self._book(spec)

    def _settle(self, spec: Speculation, outcome: str) -> None:
        with self.lock:
            if spec.outcome is not None:
                return
            spec.outcome = outcome
            self._book(spec)
            listener = spec._listener
        if listener is not None:
            listener(outcome)

    def _take_dropped(self) -> None:
        while self.dropped:
            try:
                spec = self.dropped.popleft()
            except IndexError:  # another thread took the last one
                return
            self._settle(spec, DISCARDED)

    def _book(self, spec: Speculation) -> None:
        """Count what `spec`'s events make due, each thing once, whatever their order (the lock held)."""
        if spec._started_at is None:
            return  # never admitted: nothing ran, nothing to count
        counts = self._counts
        if not spec._counted and spec.outcome is not None:
            spec._counted = True
            counts[f"speculative_{spec.outcome}"] += 1
        if spec.outcome == DISCARDED and spec._ended_at is not None and not spec._charged:
            spec._charged = True
            counts["speculative_discarded_audio_s"] += spec._generated_s
            counts["speculative_discarded_open_s"] += (spec._released_at or spec._ended_at) - spec._started_at
