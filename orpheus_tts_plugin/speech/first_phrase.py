"""Speech from the first phrase: where a reply's first phrase ends, so the TTS can start before its first sentence has.

An agent's TTS waits for the LLM's first full sentence before it speaks; at an LLM's pace that is the time to
its first token plus the whole sentence's tokens. Cutting the reply's first piece at a clause mark (`,` `;`
`:` or a dash) once it has `min_words` words starts the voice that much sooner; the rest of the reply follows
in sentences, as before. The cost is prosody: the first phrase is spoken as a unit of its own, without the rest
of its sentence to shape its intonation (docs/pipecat.md, docs/livekit.md). Framework-free: the Pipecat and
LiveKit adapters wrap their sentence splitters around `FirstPhrase` (pipecat/tts.py, livekit/tts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

CLAUSE_MARKS = frozenset(",;:—–")
SENTENCE_MARKS = frozenset(".!?…")


class Cut(Enum):
    """What the text held so far says about the first phrase."""

    WAIT = "wait"  # no clause mark after enough words yet, no sentence end: keep holding
    PHRASE = "phrase"  # the first phrase ends at the returned index: speak it now
    SENTENCE = "sentence"  # a sentence ended first: the sentence splitter takes over (no phrase cut)


@dataclass(frozen=True)
class FirstPhrase:
    """The first-phrase rule: cut at the first clause mark followed by a space once `min_words` words precede it.

    A mark only counts once the next character (a space) has arrived, so "1,000" or "3:30" never cut; a sentence
    mark followed by a space before any such cut hands the reply to the sentence splitter unchanged.
    """

    min_words: int = 3

    def __post_init__(self) -> None:
        if self.min_words < 1:
            raise ValueError(f"first phrase min_words must be >= 1, got {self.min_words!r}")

    def find(self, text: str) -> tuple[Cut, int]:
        """Where the first phrase of `text` (a reply's text so far) ends: (PHRASE, end index), or (WAIT or
        SENTENCE, 0)."""
        words = 0
        in_word = False
        for i, char in enumerate(text):
            if char.isspace():
                in_word = False
                continue
            if char.isalnum() and not in_word:
                words += 1
            in_word = in_word or char.isalnum()
            followed_by_space = i + 1 < len(text) and text[i + 1].isspace()
            if not followed_by_space:
                continue
            if char in SENTENCE_MARKS:
                return Cut.SENTENCE, 0
            if char in CLAUSE_MARKS and words >= self.min_words:
                return Cut.PHRASE, i + 1
        return Cut.WAIT, 0


def min_words_of(value: int | FirstPhrase | None) -> FirstPhrase | None:
    """The rule an adapter option names: None (off), a minimum number of words, or a `FirstPhrase`."""
    if value is None or isinstance(value, FirstPhrase):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"first_phrase must be None, an int (minimum words) or a FirstPhrase, got {value!r}")
    return FirstPhrase(min_words=value)


class FirstPhraseSplitter:
    """One reply's text on its way to a sentence splitter: held until its first phrase is cut (or a sentence ends
    first), then passed on as it comes. One per reply; owned by whoever feeds the reply's text (one task)."""

    def __init__(self, rule: FirstPhrase):
        self._rule = rule
        self._head = ""
        self.decided = False  # the first phrase was cut, or will not be: everything now passes straight on

    def feed(self, text: str) -> tuple[str | None, str]:
        """Take the reply's next text: (the first phrase if it is cut now, else None; text for the sentence
        splitter, which follows the phrase)."""
        if self.decided:
            return None, text
        self._head += text
        cut, at = self._rule.find(self._head)
        if cut is Cut.WAIT:
            return None, ""
        self.decided = True
        head, self._head = self._head, ""
        if cut is Cut.PHRASE:
            return head[:at].strip(), head[at:]
        return None, head

    def finish(self) -> str:
        """The reply's text has all come: what is still held, for the sentence splitter."""
        head, self._head = self._head, ""
        self.decided = True
        return head

    @property
    def held(self) -> str:
        """The text held back so far."""
        return self._head
