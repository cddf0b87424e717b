"""A RemoteEngine's counters (its streams' outcomes, connects, failovers: counted on any thread) and each server's
part of its `stats()`."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from .router import CallerStream
from .upstream import Upstream


class Counters:
    """Counts by name, from any thread (its own lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _counts
        self._counts: collections.Counter[str] = collections.Counter()

    def count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def by_server(upstreams: Sequence[Upstream], open_streams: Iterable[CallerStream]) -> dict[str, dict[str, Any]]:
    """Each server's connection, load, this process's streams open on it, connects, last error and last status (by
    URL; from any thread: it reads what the connection's loop replaces)."""
    streams = collections.Counter(s.upstream.url for s in list(open_streams) if s.upstream is not None)
    return {
        u.url: {
            "connected": u.conn is not None,
            "load": u.load,
            "active_streams": streams[u.url],
            "connects": u.connects,
            "last_error": u.last_error,
            "status": dict(u.status),
            **u.posts_stats(),
        }
        for u in upstreams
    }
