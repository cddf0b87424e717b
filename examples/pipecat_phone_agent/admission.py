"""How many calls one agent process carries at once: it admits calls up to its capacity and refuses the rest at once,
so that the calls it has admitted stay real time (a call past the knee slows every call in the process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

BUSY_CLOSE_CODE = 1013  # WebSocket close code "Try Again Later" (RFC 6455's IANA registry)
BUSY_REASON = "busy: at capacity"
HOLD_S = 10.0  # how long a place told to connect waits for its call's media stream before another call may take it


@dataclass
class Admission:
    """The process's calls against its capacity. Owned by the server's event loop: each method checks and counts with
    no await in between, so two calls racing for the last place cannot both get it.

    A call told to connect (the TwiML answer) holds a place, by its CallSid, until its media stream starts: a burst of
    calls is refused at the TwiML answer, not after Twilio has answered them."""

    capacity: int
    clock: Callable[[], float] = time.monotonic
    active: int = 0  # calls in progress
    total: int = 0  # calls admitted since the server started
    refused: int = 0  # calls turned away: TwiML <Reject> or a media stream closed at its start
    held: dict[str, float] = field(default_factory=dict)  # CallSid → until when its place is held

    @property
    def full(self) -> bool:
        """Whether a new call would be refused now."""
        self._drop_expired_holds()
        return self.active + len(self.held) >= self.capacity

    @property
    def load(self) -> float:
        """LiveKit's worker load figure: 0.0 idle, 1.0 full (a worker past its `load_threshold` gets no new jobs)."""
        taken = self.active + len(self.held)
        return 1.0 if self.capacity <= 0 else min(1.0, taken / self.capacity)

    def hold(self, call_sid: str) -> bool:
        """Hold a place for a call about to be told to connect, or count it refused (False). A request with no
        CallSid (not Twilio's) holds nothing: no media stream could claim the place; its stream is checked alone."""
        if self.full:
            self.refused += 1
            return False
        if call_sid:
            self.held[call_sid] = self.clock() + HOLD_S
        return True

    def try_admit(self, call_sid: str) -> bool:
        """Take the place held for the call, or a free one, or count it refused (False); the caller must `release()`
        a place it was given."""
        if self.held.pop(call_sid, None) is None and self.full:
            self.refused += 1
            return False
        self.active += 1
        self.total += 1
        return True

    def release(self) -> None:
        """Give back the place of a call that has ended."""
        self.active -= 1

    def stats(self) -> dict[str, int | float]:
        """The counts `/stats` reports under `calls`, for monitoring and for placing calls on the least loaded agent."""
        self._drop_expired_holds()
        return {
            "active": self.active,
            "held": len(self.held),
            "total": self.total,
            "capacity": self.capacity,
            "refused": self.refused,
            "load": round(self.load, 3),
        }

    def _drop_expired_holds(self) -> None:
        now = self.clock()
        for call_sid in [sid for sid, until in self.held.items() if until <= now]:
            del self.held[call_sid]
