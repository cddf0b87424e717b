"""How many calls one agent process carries at once: it admits calls up to its capacity and refuses the rest at once,
so that the calls it has admitted stay real time (a call past the knee slows every call in the process)."""

from __future__ import annotations

from dataclasses import dataclass

BUSY_CLOSE_CODE = 1013  # WebSocket close code "Try Again Later" (RFC 6455's IANA registry)
BUSY_REASON = "busy: at capacity"


@dataclass
class Admission:
    """The process's calls against its capacity. Owned by the server's event loop: `try_admit` checks and counts with
    no await in between, so two calls racing for the last place cannot both get it."""

    capacity: int
    active: int = 0  # calls in progress
    total: int = 0  # calls admitted since the server started
    refused: int = 0  # calls turned away: TwiML <Reject> or a media stream closed at its start

    @property
    def full(self) -> bool:
        """Whether a new call would be refused now."""
        return self.active >= self.capacity

    @property
    def load(self) -> float:
        """LiveKit's worker load figure: 0.0 idle, 1.0 full (a worker past its `load_threshold` gets no new jobs)."""
        return 1.0 if self.capacity <= 0 else min(1.0, self.active / self.capacity)

    def try_admit(self) -> bool:
        """Take a place for a call, or count it refused; the caller must `release()` a place it was given."""
        if self.full:
            self.refused += 1
            return False
        self.active += 1
        self.total += 1
        return True

    def refuse(self) -> None:
        """Count a call turned away before it asked for a place (the TwiML answer of a full agent)."""
        self.refused += 1

    def release(self) -> None:
        """Give back the place of a call that has ended."""
        self.active -= 1

    def stats(self) -> dict[str, int | float]:
        """The counts `/stats` reports under `calls`, for monitoring and for placing calls on the least loaded agent."""
        return {
            "active": self.active,
            "total": self.total,
            "capacity": self.capacity,
            "refused": self.refused,
            "load": round(self.load, 3),
        }
