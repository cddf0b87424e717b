"""A reply's speech, framework-free: the room both adapters speak through (pipecat/tts.py, livekit/tts.py).

A voice agent's reply arrives as streamed LLM text. `ReplyText` cuts it into what to speak, in order: the first
phrase (first_phrase.py), then sentences. `ReplySpeech` speaks those texts through an engine on one timeline:
audio chunks and their words (words.py), timed in samples from the reply's start and, for a framework that
stamps words with wall-clock times, on its playout (`Playout`).

A reply can be spoken speculatively, before the caller's turn is confirmed: its audio is **held** (the engine
generates it, nothing leaves), then **released** at once when the turn is confirmed, or **discarded** when the
caller goes on: every engine stream of the reply is closed (aborted within one engine step) and no audio or word
of it is given out. The engine counts each speculative stream as confirmed or discarded (`Speech.confirm`).

Owned by one task of one event loop (the adapter's); nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..spec import SAMPLE_RATE, ModelSpec
from ..types import AudioChunk, Speech, SpeechEngine, SpeechOptions
from .first_phrase import SENTENCE_MARKS, FirstPhrase, FirstPhraseSplitter
from .text import sentences
from .words import Pace, TimedWord, WordTimer

Splitter = Callable[[str], list[str]]  # text -> its sentences (the last may still be unfinished)


def language_voice(spec: ModelSpec, language: str | None, voice: str | None, current: str | None = None) -> str | None:
    """The voice that speaks `language`: `voice` if given; else `current` if it speaks the language, else the
    language's default voice (None without a language: the engine's default). ValueError if the model family
    does not speak `language`."""
    if language is None:
        return voice
    spec.check_language(language)
    return voice if voice is not None else spec.voice_for_language(language, current)


class ReplyText:
    """One reply's streamed text cut into texts to speak: its first phrase (if `rule` cuts one), then sentences.

    A sentence is given out once the next one has begun (`split` returned more than one piece) or once its end
    mark is followed by a space (at an LLM's pace the next token may be ~10 ms away: not worth waiting for; an
    abbreviation such as "etc. " may then end a piece early), the last at `finish()`. `split`: a framework's
    sentence splitter, or the engine's (text.py `sentences`).
    """

    def __init__(self, rule: FirstPhrase | None = None, split: Splitter = sentences):
        self._head = None if rule is None else FirstPhraseSplitter(rule)
        self._split = split
        self._buffer = ""

    @property
    def held(self) -> str:
        """The text not given out yet."""
        return ((self._head.held if self._head else "") + self._buffer).strip()

    def feed(self, text: str) -> list[str]:
        """Take the reply's next text; the texts now ready to speak, in order."""
        out: list[str] = []
        if self._head is not None and not self._head.decided:
            phrase, text = self._head.feed(text)
            if phrase:
                out.append(phrase)
        self._buffer += text
        pieces = self._split(self._buffer) if self._buffer.strip() else []
        ended = self._buffer[-1:].isspace() and pieces and pieces[-1][-1:] in SENTENCE_MARKS
        done = len(pieces) if ended else len(pieces) - 1
        if done > 0:
            out.extend(pieces[:done])
            tail = " ".join(pieces[done:])
            self._buffer = tail + " " if tail and self._buffer[-1:].isspace() else tail
        return out

    def finish(self) -> list[str]:
        """The reply's text has all come: what is still held, as texts to speak."""
        rest = (self._head.finish() if self._head else "") + self._buffer
        self._buffer = ""
        return self._split(rest) if rest.strip() else []


class ReplayText:
    """A reply's text as it was pushed, each flush as None, replayed from the start to each reader (each attempt of
    a framework that retries a stream from its start)."""

    def __init__(self) -> None:
        self._items: list[str | None] = []
        self._ended = False
        self._changed = asyncio.Event()

    def add(self, item: str | None) -> None:
        """Keep a token (empty ones are dropped, as LiveKit does) or a flush (None), unless the input has ended."""
        if item != "" and not self._ended:
            self._items.append(item)
            self._changed.set()

    def end(self) -> None:
        """No more text will come."""
        self._ended = True
        self._changed.set()

    async def replay(self) -> AsyncIterator[str | None]:
        """Everything pushed, from the first token, waiting for more until the input ends."""
        sent = 0
        while True:
            while sent < len(self._items):
                sent += 1
                yield self._items[sent - 1]
            if self._ended:
                return
            self._changed.clear()
            await self._changed.wait()


class Playout:
    """When each sample of a reply plays, in seconds after its first chunk was given out.

    A chunk plays once it is given out and once the audio before it has played, as a listener's buffer plays
    it: when generation falls behind real time, the gap delays every later word with the audio.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE):
        self._rate = sample_rate
        self._t0: float | None = None
        self._played = 0.0  # when the audio given out so far has finished playing
        self._starts: list[int] = []  # the first reply sample of each chunk
        self._times: list[float] = []  # when that chunk starts playing

    def deliver(self, now: float, start: int, num_samples: int) -> None:
        """Note the chunk of reply samples [start, start + num_samples) given out at `now` (seconds, any clock)."""
        if self._t0 is None:
            self._t0 = now
        at = max(now - self._t0, self._played)
        self._starts.append(start)
        self._times.append(at)
        self._played = at + num_samples / self._rate

    def seconds_at(self, sample: int) -> float:
        """When reply sample `sample` (already given out) plays, in seconds after the first chunk."""
        i = max(bisect.bisect_right(self._starts, sample) - 1, 0)
        return self._times[i] + (sample - self._starts[i]) / self._rate


@dataclass(frozen=True)
class Spoken:
    """A chunk of a reply's audio and the words whose estimated end it reaches, in reply samples."""

    chunk: AudioChunk
    start: int  # the reply sample this chunk begins at
    words: list[TimedWord]


class ReplyDiscarded(Exception):
    """The reply was discarded while a text of it was being spoken: nothing more of it is given out."""


class ReplySpeech:
    """Speaks one reply's texts in order on one timeline; its audio can be held, released or discarded.

    `held=True`: a speculative reply, its audio held until `release()`; its engine streams are speculative
    (counted confirmed at `release()`, discarded at `discard()`). `clock`: seconds, for the playout.
    """

    def __init__(
        self,
        engine: SpeechEngine,
        options: SpeechOptions,
        pace: Pace,
        *,
        held: bool = False,
        clock: Callable[[], float] | None = None,
    ):
        self._engine = engine
        self.options = options  # what each next text is spoken with (the adapter's settings may change mid-reply)
        self._pace = pace
        self._speculative = held
        self._released = asyncio.Event()
        if not held:
            self._released.set()
        self._discarded = False
        self._gone = asyncio.Event()  # set at discard: wakes a speculative `speak` waiting on the engine
        self._streams: list[Speech] = []  # every stream of a speculative reply (confirmed at release), else open ones
        self._clock = clock or asyncio.get_running_loop().time
        self.samples = 0  # reply samples given out so far
        self.playout = Playout()

    @property
    def held(self) -> bool:
        """True while the reply's audio is held."""
        return not self._released.is_set() and not self._discarded

    @property
    def discarded(self) -> bool:
        return self._discarded

    @property
    def serving(self) -> bool:
        """The engine still serves (not failed or closed): a failure now concerns this reply, not the engine."""
        return self._engine.health()["status"] not in ("failed", "closed")

    def _gone_while_held(self) -> asyncio.Event | None:
        """What a wait on the engine races while the audio is held (a discard from another task); None once it is
        out, when the framework cancels the speaking task itself and a race would only cost a task a chunk."""
        return self._gone if self.held else None

    def release(self) -> None:
        """Let the held audio out at once; its speculative streams are confirmed."""
        if self._discarded or self._released.is_set():
            return
        for stream in self._streams:
            stream.confirm()
        self._released.set()

    async def discard(self) -> None:
        """Drop the reply: its engine streams are aborted, nothing more of it is given out."""
        if self._discarded:
            return
        self._discarded = True
        self._gone.set()  # wakes a `speak` waiting for its release or for the engine: it closes its own stream
        streams, self._streams = self._streams, []
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # "already running": being closed by its own `speak` task
                await stream.aclose()

    async def speak(self, text: str, timeout: float | None = None) -> AsyncIterator[Spoken]:
        """`text`'s audio, chunk by chunk, each with the words it completes, once the reply is released.

        `timeout`: seconds the engine may take for each chunk (the first: from the request), past it TimeoutError;
        a held reply's wait for its release does not count. Leaving the loop early aborts the engine stream.
        ReplyDiscarded if the reply is discarded meanwhile.
        """
        if self._discarded:
            raise ReplyDiscarded("reply discarded")
        speculative = self._speculative and self.held
        stream = self._engine.synthesize(text, options=self.options, speculative=speculative)
        self._streams.append(stream)
        words = WordTimer(stream.sentences, self._pace, speed=self.options.speed)
        base = self.samples
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in _in_time(stream, timeout, self._gone_while_held):
                    if not self._released.is_set():
                        await _first(self._released.wait(), self._gone.wait())
                    if self._discarded:
                        raise ReplyDiscarded("reply discarded")
                    start = base + chunk.start_sample
                    self.playout.deliver(self._clock(), start, chunk.num_samples)
                    self.samples = start + chunk.num_samples
                    timed = [TimedWord(w.text, base + w.start, base + w.end, w.sample_rate) for w in words.feed(chunk)]
                    yield Spoken(chunk, start, timed)
        finally:
            if not speculative and stream in self._streams:
                self._streams.remove(stream)  # a confirmed or plain stream needs nothing more at release


async def _first(*waits: Awaitable[Any]) -> None:
    """Wait until the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _in_time(
    chunks: Speech, timeout: float | None, gone: Callable[[], asyncio.Event | None]
) -> AsyncIterator[AudioChunk]:
    """The chunks of `chunks`, each within `timeout` seconds of the previous one (the first: of the request).

    Past it, TimeoutError; the wait was cancelled inside the engine's generator, which aborts the engine request
    within one engine step. The wait for a cold engine's load counts too. `gone()`, asked before each
    wait: an event that also ends it, with ReplyDiscarded (a discard from another task), or None for a plain wait
    (a race costs a task a chunk: only a held reply races).
    """
    while True:
        step = chunks.__anext__() if timeout is None else asyncio.wait_for(chunks.__anext__(), timeout)
        try:
            discarded = gone()
            if discarded is None:
                yield await step
                continue
            task = asyncio.ensure_future(step)
            try:
                await _first(asyncio.shield(task), discarded.wait())
            finally:  # discarded, or this task cancelled: the engine's generator must not be left running
                if not task.done():
                    task.cancel()  # cancelled inside the engine's generator: the request is aborted within one step
                    await asyncio.wait([task])
            if task.cancelled():
                raise ReplyDiscarded("reply discarded")
            yield task.result()
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:  # builtin TimeoutError from 3.11; a distinct class on 3.10
            raise TimeoutError(f"no audio from the engine within {timeout:g} s (conn_options.timeout)") from None
