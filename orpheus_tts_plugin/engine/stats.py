"""The engine's counters: streams by outcome, utterances, tokens, frames, finish reasons and bad ids, as `stats()`
reports them (any thread counts)."""

from __future__ import annotations

import collections
import threading

from ..backends.protocol import FinishReason
from ..codec.codes import FrameParser

# Counters stats() always has, zero until counted (the others appear when they first happen).
STREAM_COUNTERS = ("streams_started", "streams_completed", "streams_cancelled", "streams_failed", "streams_rejected")


class Counters:
    """Named counts of the whole engine, from any thread (its own lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _counts
        self._counts: collections.Counter[str] = collections.Counter(dict.fromkeys(STREAM_COUNTERS, 0))

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def count_utterance(self, parser: FrameParser, n_tokens: int, finish: str | None, limit_kind: str) -> None:
        """One utterance generated: its tokens, frames, bad ids, and why it ended (`limit_kind` if at a limit)."""
        reason = limit_kind if finish == FinishReason.LENGTH else finish
        with self._lock:
            self._counts["utterances"] += 1
            self._counts["tokens"] += n_tokens
            self._counts["frames"] += parser.frames_out
            self._counts[f"finish_{reason}"] += 1
            for key, n in parser.errors.items():
                self._counts[f"invalid_{key}"] += n

    def snapshot(self) -> dict[str, int]:
        """Every count so far, in the order each first happened."""
        with self._lock:
            return dict(self._counts)
