"""The decoder thread: turns each stream's frames into audio in batched calls and delivers it to callers' loops.

Threads: `DecodeWorker.open`, `push`, `kick`, `end` and `drop` run on the engine loop; the rest on the
decoder thread. A `CallerStream` lives on its caller's loop; which thread writes each of its fields is
written beside it. Audio reaches each caller's loop through one `call_soon_threadsafe` per loop per tick.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EngineError
from ..runtime.loop_thread import Outbox
from ..runtime.mailbox import Mailbox
from ..spec import SAMPLE_RATE
from ..types import AudioChunk, Usage

if TYPE_CHECKING:
    from ..codec.decoder import DecodeState, FrameDecoder
    from ..speculation import Speculation

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 1.0  # the idle decoder thread hands freed heap memory back to the OS at most this often


class CallerStream:
    """Caller-side handle of one synthesize() stream; lives on the caller's event loop."""

    __slots__ = (
        "box",
        "closed",
        "first_audio_at",
        "frames",
        "id",
        "loop",
        "paused",
        "resumed",
        "samples",
        "speculation",
        "task",
        "taken",
        "usage",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, speculation: Speculation | None = None, usage: Usage | None = None
    ):
        self.id = uuid.uuid4().hex
        self.loop = loop
        self.speculation = speculation  # a speculative stream's outcome and cost (any thread: its own lock)
        self.frames = 0  # frames generated for it (engine loop only)
        self.closed = False  # set by the caller when it leaves early; read by every thread
        self.samples = 0  # written by the decoder thread only
        self.first_audio_at: float | None = None  # monotonic time its first audio left the decoder (decoder thread)
        self.task: asyncio.Task[None] | None = None  # the engine-loop task generating its tokens (engine loop only)
        self.box: Mailbox[AudioChunk] = Mailbox()  # caller's loop only
        self.taken = 0  # samples the caller has taken (caller's loop writes; the engine loop reads)
        self.paused = False  # generation waits for the caller to read (engine loop writes; caller's loop reads)
        self.resumed: asyncio.Event | None = None  # set when the caller has caught up (engine loop only)
        self.usage = usage if usage is not None else Usage()  # its tokens (the engine loop writes; see Usage)

    def unread_s(self) -> float:
        """Seconds of decoded audio on its way to the caller or waiting for it to take it."""
        return (self.samples - self.taken) / SAMPLE_RATE

    def put(self, item: AudioChunk | BaseException) -> None:
        """Runs on the caller's loop: a chunk, or the error that ends the stream (nothing after either end)."""
        if self.closed or self.box.ended:
            return
        if isinstance(item, BaseException):
            self.box.end(item)
        else:
            self.box.put(item)


@dataclass(eq=False)
class Utterance:
    """One sentence of a stream on its way through the decoder; fields guarded by the worker's lock."""

    stream: CallerStream
    index: int  # the sentence's place in the stream's text
    last: bool
    state: DecodeState  # decoder thread only, once opened
    incoming: list[np.ndarray] = field(default_factory=list)  # engine loop appends, decoder thread takes
    ended: bool = False  # set by the engine loop when generation of this utterance is over


class DecodeWorker:
    """The decoder thread: each tick decodes the head utterance of every stream in batched calls and delivers.

    Only a stream's oldest unfinished utterance is decoded, so its sentences come out in order, each one
    whole. A stream whose delivered audio is more than `ahead_s` ahead of real time (counted from its
    first audio) has its frames held until the decoder's `ahead_chunk_frames` are pending, or until it
    is no longer that far ahead: a call of several frames costs less per frame (docs/benchmarks.md).
    `open`, `push`, `end` and `drop` run on the engine loop; everything else on the decoder thread.
    """

    def __init__(
        self,
        decoder: FrameDecoder,
        on_done: Callable[[CallerStream], None],
        on_error: Callable[[CallerStream, EngineError], None],
        on_dead: Callable[[BaseException], None],
        ahead_s: float | None = None,
    ):
        self.decoder = decoder
        self.ahead_s = math.inf if ahead_s is None else ahead_s  # None: never hold
        self._ahead_frames = decoder.ahead_chunk_frames
        self._on_done, self._on_error, self._on_dead = on_done, on_error, on_dead
        self._cv = threading.Condition()
        self._queues: dict[CallerStream, collections.deque[Utterance]] = {}  # under _cv; insertion order
        self._dropped: list[Utterance] = []  # under _cv: states the decoder thread must release
        self._running = True
        self.ticks = 0  # decoder thread only
        self._trimmed_at = 0.0
        self._trimmed_tick = 0
        self._thread = threading.Thread(target=self._main, name="orpheus-decoder", daemon=True)
        self._thread.start()

    # -- engine loop side --
    def open(self, stream: CallerStream, index: int, last: bool) -> Utterance:
        utt = Utterance(stream, index, last, self.decoder.new_state())
        with self._cv:
            self._queues.setdefault(stream, collections.deque()).append(utt)
        return utt

    def push(self, utt: Utterance, frames: np.ndarray) -> None:
        """Queue frames; the decoder looks at them on its next tick or `kick()`."""
        with self._cv:
            utt.incoming.append(frames)

    def kick(self) -> None:
        """Wake the decoder thread (once per engine-loop iteration, not once per frame)."""
        with self._cv:
            self._cv.notify()

    def end(self, utt: Utterance) -> None:
        with self._cv:
            utt.ended = True
            self._cv.notify()

    def drop(self, stream: CallerStream) -> None:
        """Forget a stream: nothing of it is decoded any more (its decoder state is freed on the next tick)."""
        with self._cv:
            self._dropped.extend(self._queues.pop(stream, ()))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        self._thread.join()

    # -- decoder thread --
    def _collect(self) -> tuple[list[Utterance], float]:
        """Under the lock: free dropped states, take new frames, and list the heads that can be decoded now,
        with the monotonic time at which a held head stops being held (inf if none is held)."""
        for utt in self._dropped:
            self.decoder.release(utt.state)
        self._dropped.clear()
        ready = []
        first = self.decoder.first_chunk_frames
        now, release_at = time.monotonic(), math.inf
        for queue in self._queues.values():
            utt = queue[0]
            if utt.incoming:
                utt.state.pending.extend(utt.incoming)
                utt.incoming.clear()
            utt.state.final = utt.ended
            if not utt.state.ready(first):
                continue
            stream = utt.stream
            until = held_until(utt.state, stream.first_audio_at, stream.samples, self.ahead_s, self._ahead_frames)
            if until > now:
                release_at = min(release_at, until)
            else:
                ready.append(utt)
        return ready, release_at

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - the engine must learn that its decoder is gone
            log.exception("Orpheus decoder thread died")
            self._on_dead(exc)

    def _run(self) -> None:
        while True:
            with self._cv:
                ready, release_at = self._collect()
                while self._running and not ready:
                    self._cv.wait(self._wait_s(release_at))
                    ready, release_at = self._collect()
                if not self._running:
                    return
            self._tick(ready)

    def _tick(self, ready: list[Utterance]) -> None:
        try:
            results = self.decoder.decode([u.state for u in ready])
        except Exception as exc:  # noqa: BLE001 - a decoder bug fails the streams of this tick, not the engine
            results = [exc] * len(ready)
        self.ticks += 1
        outbox: Outbox[CallerStream] = Outbox()
        done: list[CallerStream] = []
        failed: list[tuple[CallerStream, EngineError]] = []
        with self._cv:
            for utt, audio in zip(ready, results):
                stream = utt.stream
                if stream not in self._queues:  # dropped while this tick ran
                    continue
                if isinstance(audio, Exception):
                    error = EngineError(f"decoding failed: {type(audio).__name__}: {audio}")
                    error.__cause__ = audio
                    self._dropped.extend(self._queues.pop(stream))
                    failed.append((stream, error))
                    outbox.add(stream, error)
                    continue
                final = utt.last and utt.state.done
                if utt.state.done:
                    self._queues[stream].popleft()
                    if not self._queues[stream]:
                        del self._queues[stream]
                if stream.closed or (audio.size == 0 and not final):
                    continue
                chunk = AudioChunk(audio.tobytes(), stream.samples, final, SAMPLE_RATE, utt.index, utt.state.done)
                if stream.first_audio_at is None and audio.size:
                    stream.first_audio_at = time.monotonic()
                stream.samples += audio.size
                outbox.add(stream, chunk)
                if final:
                    done.append(stream)
        for stream in done:  # no longer active once its caller holds the final chunk
            self._on_done(stream)
        gone = outbox.send()  # before on_error: a failed stream's error reaches its caller first
        for stream, error in failed:
            self._on_error(stream, error)
        for stream in gone:
            stream.closed = True
            with self._cv:
                self._dropped.extend(self._queues.pop(stream, ()))
            self._on_error(stream, EngineError("the caller's event loop is closed"))

    def _wait_s(self, release_at: float) -> float | None:
        """How long the idle decoder thread may sleep: until a held stream is released, or an idle trim is due."""
        trim = self._idle_trim()
        if release_at == math.inf:
            return trim
        held = max(0.0, release_at - time.monotonic())
        return held if trim is None else min(held, trim)

    def _idle_trim(self) -> float | None:
        """With nothing to decode, hand the heap memory freed by decoding back to the OS (glibc keeps it
        otherwise), at most once a second; the seconds to wait before trying again, or None."""
        if self._queues or self.ticks == self._trimmed_tick or _MALLOC_TRIM is None:
            return None
        wait = self._trimmed_at + TRIM_INTERVAL_S - time.monotonic()
        if wait > 0:
            return wait
        self._trimmed_at, self._trimmed_tick = time.monotonic(), self.ticks
        _MALLOC_TRIM(0)
        return None


def held_until(
    state: DecodeState, first_audio_at: float | None, samples: int, ahead_s: float, ahead_frames: int
) -> float:
    """Monotonic time until which a ready utterance's pending frames wait for more (in the past: decode now).

    They wait while its stream's delivered audio (`samples`, from its first audio at `first_audio_at`) is
    more than `ahead_s` ahead of real time and fewer than `ahead_frames` are pending; a first chunk and an
    utterance's end never wait.
    """
    if state.final or state.frames_in == 0 or first_audio_at is None or state.pending_frames >= ahead_frames:
        return -math.inf
    return first_audio_at + samples / SAMPLE_RATE - ahead_s


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


_MALLOC_TRIM = _malloc_trim()
