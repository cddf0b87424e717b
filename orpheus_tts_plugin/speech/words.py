"""Word timestamps for Orpheus audio, estimated: the model gives no alignment, so each sentence's audio is
shared out among its words by a per-word weight (syllables of the spoken form, plus a constant per word and
pauses after punctuation), as the sentence's chunks arrive.

`WordTimer.feed(chunk)` takes a stream's `AudioChunk`s in order and returns the words whose estimated end
lies inside the audio delivered so far, each once, in order. Until a sentence's last chunk its length is
unknown, so words are placed by a speaking-rate prior (`Pace`, learnt from the sentences already heard);
at the last chunk the words not yet given are re-timed to fill the rest of the sentence's audio exactly.
Emotion tags (`<laugh>`) take audio but are never returned as words. No framework, no torch: the
Pipecat and LiveKit adapters both build on it. Accuracy against speech with known word times:
docs/word-timestamps.md (`scripts/word_timing_accuracy.py`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from ..spec import SAMPLE_RATE

_TAG = re.compile(r"<[A-Za-z_]+>")
_PIECE = re.compile(r"<[A-Za-z_]+>|[^\s<]+(?:<(?![A-Za-z_]+>)[^\s<]*)*")  # a tag, or a run up to a space or a tag
_VOWELS = re.compile(r"[aeiouy]+")
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_MONEY = re.compile(r"\$(\d[\d,]*)(?:\.(\d\d))?")
_CLAUSE_MARKS = (",", ";", ":", "—", "–", "-")
_STOP_MARKS = (".", "!", "?", "…")
_SYMBOLS = {"&": " and ", "%": " percent ", "@": " at ", "+": " plus ", "=": " equals ", "$": " ", "#": " number "}
_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred"))


@dataclass(frozen=True)
class Weights:
    """How much audio each part of a sentence gets, in units; the defaults are the measured best
    (docs/word-timestamps.md). `seconds_per_unit` is the speaking-rate prior before any sentence is heard."""

    unit: Literal["syllables", "characters", "words"] = "characters"
    per_word: float = 0.5  # units every word takes on top of its letters (or syllables)
    clause_pause: float = 6.0  # units of silence after , ; : and dashes
    stop_pause: float = 9.0  # after . ! ? inside a piece (the engine merges short sentences)
    tag: float = 10.0  # an emotion tag: audio (a laugh, a sigh) that is not a word
    lead_s: float = 0.0  # silence before the first word, seconds
    trail_s: float = 0.2  # after the last word's start share: its final lengthening and the silence after it
    seconds_per_unit: float = 0.056  # espeak-ng at its default 175 words a minute


DEFAULT_WEIGHTS = Weights()


@dataclass(frozen=True)
class Unit:
    """A word (`text` as written, punctuation kept) or an emotion tag (`text` None), with the audio it takes."""

    text: str | None
    weight: float
    pause: float = 0.0  # the silence after it, in the same units


@dataclass(frozen=True)
class TimedWord:
    """A word and where it lies in its stream's audio, in samples from the stream's first sample."""

    text: str
    start: int
    end: int
    sample_rate: int = SAMPLE_RATE

    @property
    def start_s(self) -> float:
        return self.start / self.sample_rate

    @property
    def end_s(self) -> float:
        return self.end / self.sample_rate


class ChunkLike(Protocol):
    """What WordTimer reads of an `AudioChunk`."""

    start_sample: int
    utterance: int
    utterance_end: bool

    @property
    def num_samples(self) -> int: ...


@dataclass(frozen=True)
class Span:
    """A ChunkLike without the audio: where a piece of delivered audio lies (replaying timings offline)."""

    start_sample: int
    num_samples: int
    utterance: int = 0
    utterance_end: bool = False


# ---------------------------------------------------------------------------------------------- weights
def spoken_form(token: str) -> str:
    """The words a token is read as, for weighing only: numbers spelt out, symbols named, lower case."""
    text = _MONEY.sub(lambda m: f"{m[1]} dollars" + (f" {m[2]} cents" if m[2] else ""), token.lower())
    for symbol, name in _SYMBOLS.items():
        text = text.replace(symbol, name)
    text = re.sub(r"(\d)(st|nd|rd|th)\b", r"\1", text)
    return _NUMBER.sub(lambda m: f" {_read_number(m.group())} ", text)


def _read_number(digits: str) -> str:
    """A number as said: 1,200 → one thousand two hundred; 1990 → nineteen ninety; 3.50 → three point five zero."""
    if ":" in digits:  # a time of day
        return " ".join(_read_number(part) for part in digits.split(":") if part)
    if "." in digits:
        whole, _, rest = digits.partition(".")
        return f"{_read_number(whole)} point " + " ".join(_ONES[int(d)] for d in rest if d.isdigit())
    n = int(digits.replace(",", "") or 0)
    if "," not in digits and 1100 <= n <= 2099 and n % 100 and not 2000 <= n < 2010:  # a year
        return f"{_cardinal(n // 100)} {_cardinal(n % 100)}"
    return _cardinal(n)


def _cardinal(n: int) -> str:
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else f" {_ONES[n % 10]}")
    for scale, name in _SCALES:
        if n >= scale:
            rest = n % scale
            return f"{_cardinal(n // scale)} {name}" + (f" {_cardinal(rest)}" if rest else "")
    raise AssertionError("unreachable")


def syllables(word: str) -> int:
    """Syllables of one written English word (vowel groups, a silent final e dropped); at least 1."""
    w = word.lower()
    n = len(_VOWELS.findall(w))
    if n > 1 and w.endswith("e") and not w.endswith(("le", "ee", "ye")):
        n -= 1
    return max(1, n)


def _size(token: str, unit: str) -> float:
    """Syllables (letters, or 1 a word) of what the token is read as; 0 for punctuation alone."""
    words = re.findall(r"[a-z]+", spoken_form(token))
    if unit == "words":
        return 1.0 if words else 0.0
    if unit == "characters":
        return float(sum(len(w) for w in words))
    return float(sum(syllables(w) for w in words))


def units(sentence: str, weights: Weights = DEFAULT_WEIGHTS) -> list[Unit]:
    """The words and tags of one sentence, in order, each with its weight and the pause after it.

    A token with no letters or digits (a dash, an ellipsis) is not a word: its text joins the word before
    it and it adds only its pause.
    """
    out: list[Unit] = []
    for match in _PIECE.finditer(sentence):
        piece = match.group()
        if _TAG.fullmatch(piece):
            out.append(Unit(None, weights.tag))
            continue
        pause = _pause_after(piece, weights)
        size = _size(piece, weights.unit)
        if size:
            out.append(Unit(piece, weights.per_word + size, pause))
            continue
        last = next((i for i in range(len(out) - 1, -1, -1) if out[i].text is not None), None)
        if last is not None:
            glue = " " if sentence[match.start() - 1].isspace() else ""
            out[last] = replace(out[last], text=f"{out[last].text}{glue}{piece}")
        out.append(Unit(None, 0.0, pause))
    if out:  # the silence after the last word is the sentence's tail, not a pause between words
        out[-1] = replace(out[-1], pause=0.0)
    return out


def _pause_after(token: str, weights: Weights) -> float:
    stripped = token.rstrip("\"'”’)]")
    if stripped.endswith(_STOP_MARKS):
        return weights.stop_pause
    if stripped.endswith(_CLAUSE_MARKS):
        return weights.clause_pause
    return 0.0


def total_weight(parts: list[Unit]) -> float:
    """The units a sentence's speech spans: every weight and every pause between them."""
    return sum(u.weight + u.pause for u in parts) - (parts[-1].pause if parts else 0.0)


def place(parts: list[Unit], start: float, scale: float) -> list[tuple[float, float]]:
    """(start, end) of each unit laid end to end from `start`, `scale` samples per weight unit."""
    spans, t = [], start
    for u in parts:
        spans.append((t, t + u.weight * scale))
        t += (u.weight + u.pause) * scale
    return spans


def layout(parts: list[Unit], start: float, end: float) -> list[tuple[float, float]]:
    """(start, end) of each unit when `parts` fill [start, end] in proportion to their weights and pauses."""
    total = total_weight(parts)
    return place(parts, start, max(end - start, 0.0) / total if total > 0 else 0.0)


def estimate(sentence: str, num_samples: int, weights: Weights = DEFAULT_WEIGHTS) -> list[TimedWord]:
    """The words of one sentence timed within its whole audio of `num_samples` (the length known)."""
    parts = units(sentence, weights)
    lead, trail = _edges(num_samples, weights)
    spans = layout(parts, lead, num_samples - trail)
    return [TimedWord(u.text, round(a), round(b)) for u, (a, b) in zip(parts, spans) if u.text is not None]


def _edges(num_samples: float, weights: Weights, sample_rate: int = SAMPLE_RATE) -> tuple[float, float]:
    """Lead and trail silence in samples, never more than a third of the audio together."""
    lead, trail = weights.lead_s * sample_rate, weights.trail_s * sample_rate
    shrink = min(1.0, num_samples / 3 / (lead + trail)) if lead + trail > 0 else 1.0
    return lead * shrink, trail * shrink


# ---------------------------------------------------------------------------------------------- incremental
@dataclass
class Pace:
    """The speaking-rate prior: samples per weight unit, learnt from each sentence whose length is known.

    One per voice and caller (a service, a TTS instance): a sentence's length teaches the next one's timing.
    """

    weights: Weights = DEFAULT_WEIGHTS
    sample_rate: int = SAMPLE_RATE
    learn_rate: float = 0.5  # weight of the latest sentence in the running estimate
    samples_per_unit: float = field(init=False)

    def __post_init__(self) -> None:
        self.samples_per_unit = self.weights.seconds_per_unit * self.sample_rate

    def learn(self, parts: list[Unit], num_samples: int) -> None:
        """Fold in one finished sentence: `parts` filled `num_samples` samples."""
        total = total_weight(parts)
        lead, trail = _edges(num_samples, self.weights, self.sample_rate)
        if total > 0 and num_samples > lead + trail:
            heard = (num_samples - lead - trail) / total
            self.samples_per_unit += self.learn_rate * (heard - self.samples_per_unit)


class _Sentence:
    """One sentence on its way: its units placed by the prior, given out as its audio arrives."""

    def __init__(self, text: str, base: int, pace: Pace, speed: float = 1.0):
        self.parts = units(text, pace.weights)
        self.base = base  # the stream sample where the sentence's audio begins
        self.pace = pace
        self.speed = speed  # the audio is stretched to 1/speed of its length: so is the prior's placing
        lead, _ = _edges(float("inf"), pace.weights, pace.sample_rate)
        self.spans = place(self.parts, lead, pace.samples_per_unit / speed)
        self.given = 0  # units handed out (or passed, for tags)

    def advance(self, delivered: int) -> list[TimedWord]:
        """The units whose planned end lies within the first `delivered` samples of the sentence."""
        end = self.given
        while end < len(self.parts) and self.spans[end][1] <= delivered:
            end += 1
        return self._give(end)

    def finish(self, length: int) -> list[TimedWord]:
        """The sentence is `length` samples long: re-time the units not yet given to fill the rest of it."""
        rest = self.parts[self.given :]
        if rest:
            lead, trail = _edges(length, self.pace.weights, self.pace.sample_rate)
            if self.given:  # after the last word given, which may already reach into the tail
                prev = self.parts[self.given - 1]
                start = self.spans[self.given - 1][1]
                stop = length - trail if length - trail > start else length
                rest_spans = layout([Unit(None, prev.pause), *rest], start, stop)[1:]
            else:
                rest_spans = layout(rest, lead, length - trail)
            self.spans[self.given :] = rest_spans
        self.pace.learn(self.parts, round(length * self.speed))  # the pace is learnt at speed 1
        return self._give(len(self.parts))

    def _give(self, end: int) -> list[TimedWord]:
        out = [
            TimedWord(u.text, self.base + round(a), self.base + round(b), self.pace.sample_rate)
            for u, (a, b) in zip(self.parts[self.given : end], self.spans[self.given : end])
            if u.text is not None
        ]
        self.given = end
        return out


class WordTimer:
    """Times the words of one `synthesize()` stream from its chunks, in order, each word once."""

    def __init__(self, sentences: Sequence[str], pace: Pace | None = None, hold_s: float = 0.0, speed: float = 1.0):
        """`sentences`: what the stream speaks, as its engine split it (`Speech.sentences`); `speed`: the stream's
        (`SpeechOptions.speed`), whose stretched audio the words are placed in (the prior scaled by 1/speed).

        `hold_s`: audio seconds a word waits past its estimated end before it is given out by the prior;
        more is more accurate (more words timed with the sentence's length known), later when generation
        is barely real time.
        """
        self._texts = sentences
        self._pace = pace or Pace()
        self._hold = round(hold_s * self._pace.sample_rate)
        self._current: _Sentence | None = None
        self._index = -1
        self._speed = speed

    def feed(self, chunk: ChunkLike) -> list[TimedWord]:
        """The words whose estimated end lies in the audio delivered up to and including `chunk`."""
        if chunk.utterance != self._index:
            self._index = chunk.utterance
            self._current = _Sentence(self._texts[chunk.utterance], chunk.start_sample, self._pace, self._speed)
        sentence = self._current
        assert sentence is not None
        delivered = chunk.start_sample + chunk.num_samples - sentence.base
        if chunk.utterance_end:
            return sentence.finish(delivered)
        return sentence.advance(delivered - self._hold)
