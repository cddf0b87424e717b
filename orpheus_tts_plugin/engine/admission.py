"""Admission and pacing: which streams are open (at most `max_streams`), how long a request may queue, and
when a stream's generation pauses for a slow reader and resumes.

A stream is admitted on its caller's loop, released once whichever way it ends (any thread), and ended
with an error when the engine closes or fails; its first token must come within `queue_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

from ..backends.protocol import PausableStream
from ..errors import EngineClosedError, EngineError, EngineFailedError, EngineOverloadedError
from ..runtime.loop_thread import post
from .decode_worker import CallerStream


class Admission:
    """`OrpheusEngine`'s open streams and their pace (a mixin: the engine's lock guards `_open`)."""

    def _init_admission(self) -> None:
        self._open: set[CallerStream] = set()  # under _lock
        unread = self.config.pause_unread_s
        self._pause_s = math.inf if unread is None else unread  # a stream's generation pauses past this unread
        self._resume_s = 0.0 if unread is None else unread / 2  # ... and resumes once its caller is back under this

    def _admit(self, stream: CallerStream) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            failure = self._failure or getattr(self._backend, "failure", None)
            if failure is not None:
                raise EngineFailedError(f"engine failed: {failure}")
            if len(self._open) >= self.config.max_streams:
                self._counters.count("streams_rejected")
                raise EngineOverloadedError(f"engine at capacity ({self.config.max_streams} streams)")
            self._open.add(stream)
            self._counters.count("streams_started")

    def _release(self, stream: CallerStream) -> None:
        """Stop counting `stream` as active (once, whichever way it ended)."""
        with self._lock:
            held = stream in self._open
            self._open.discard(stream)
        if held and stream.speculation is not None:
            stream.speculation.released()

    def _end_all(self, error: EngineError) -> list[CallerStream]:
        """End every open stream with `error`; the streams it ended."""
        with self._lock:
            orphans = list(self._open)
            self._open.clear()
        for stream in orphans:  # their callers are still waiting: tell them
            post(stream, error)
        return orphans

    @property
    def load(self) -> float:
        """Fraction of `max_streams` in use (what a LiveKit worker reports as its load)."""
        return len(self._open) / self.config.max_streams

    def _queue_timeout(self) -> EngineOverloadedError:
        """Engine loop: a request's first token did not come within `queue_timeout_s`; counted, its error."""
        self._counters.count("queue_timeouts")
        return EngineOverloadedError(
            f"no token within {self.config.queue_timeout_s:g} s (queue_timeout_s): the backend is full"
        )

    async def _wait_for_reader(self, stream: CallerStream, tokens: PausableStream) -> None:
        """Pause this stream's generation until its caller has read all but `pause_unread_s / 2` of its audio.

        `paused` is published before the caller's progress is read again, and the caller reads `paused` after
        publishing its progress, so one of the two always sees the other: no wake-up is lost.
        """
        event = stream.resumed = stream.resumed or asyncio.Event()
        event.clear()
        stream.paused = True
        try:
            if stream.unread_s() <= self._resume_s:
                return
            self._counters.count("generation_pauses")
            tokens.pause(True)
            try:
                await event.wait()
            finally:
                tokens.pause(False)
        finally:
            stream.paused = False

    def _taken(self, stream: CallerStream, samples: int) -> None:
        """Caller's loop: its caller took `samples` more; a paused generation it has caught up with resumes."""
        stream.taken += samples
        if stream.paused and stream.unread_s() <= self._resume_s:
            with contextlib.suppress(RuntimeError):  # the engine loop is closed: nothing to resume
                self._loop.call_soon_threadsafe(self._resume, stream)

    def _resume(self, stream: CallerStream) -> None:
        """Engine loop: `stream`'s caller has caught up; its paused generation goes on."""
        if stream.resumed is not None:
            stream.resumed.set()
