"""The one rule that sends a new stream somewhere, for RemoteEngine's list of servers (`upstream.choose`) and for Ray
Serve's proxy (`ray_router.FewestStreamsRouter`): the least loaded, where a stream counts from the moment it is sent
there (not from when the target next reports it, so a burst spreads), ties taken in turn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def least_loaded(candidates: Sequence[T], load: Callable[[T], float], turn: int) -> T:
    """The candidate of least `load`; among equals, the first from position `turn` on (round-robin when the caller
    advances `turn` each time). `candidates` must not be empty."""
    at = turn % len(candidates)
    return min([*candidates[at:], *candidates[:at]], key=load)  # min keeps the first of equals
