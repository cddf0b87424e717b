"""Input text: validation, normalisation and sentence splitting; emotion tags like <laugh> are kept."""

from __future__ import annotations

import re
import unicodedata

_SPACE = re.compile(r"\s+")
# What may follow a sentence's last mark and still belong to it: closing quotes and brackets, Latin and CJK.
_CLOSERS = "\"'”’»›)\\]}」』】〉》）］｝〕"
# A sentence ends at a run of marks (and the closers after them) that is followed by a space: Latin . ! ? …,
# Devanagari danda । and double danda ॥, Arabic question mark ؟, Urdu full stop ۔, Ethiopic ።, Armenian ։,
# Myanmar ။, and ‼ ⁇ ⁈ ⁉. Korean writes Latin marks with spaces. CJK full-width 。！？ and the half-width ｡ end
# a sentence with no space after them (Chinese and Japanese write none).
_SENTENCE_END = re.compile(rf"[.!?…।॥؟۔።։။‼⁇⁈⁉]+[{_CLOSERS}]*(?=\s)|[。！？｡]+[{_CLOSERS}]*")
# A clause ends at , ; : — – (and the Arabic comma ، and semicolon ؛) before a space, or at the full-width
# ， 、 ； ： with or without one.
_CLAUSE_END = re.compile(r"(?<=[,;:—–،؛])\s+|(?<=[，、；：])\s*")
_INITIAL = re.compile(r"(?:^|\s)\w\.$")  # a one-letter word and its period: an initial, "z." of "z. B."
_TAG = re.compile(r"<[^<>\s]{1,32}>")  # an emotion tag, never cut inside


def normalize(text: str) -> str:
    """Remove control and format characters, unify whitespace; keep every printable character."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    text = unicodedata.normalize("NFC", text)
    cleaned = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch.isspace():
            cleaned.append(" ")
        elif cat in ("Cc", "Cf", "Cs", "Co", "Cn"):
            continue
        else:
            cleaned.append(ch)
    return _SPACE.sub(" ", "".join(cleaned)).strip()


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Normalise `text` and split it into pieces of at most `max_chars`, at sentence bounds first.

    Short sentences are merged up to `max_chars` (fewer generations, natural prosody); a sentence
    longer than that is split at clause marks, then at spaces, then (text without spaces: Chinese,
    Japanese) between characters. Pieces are joined back with a space, or with none between two
    full-width characters. Numbers and abbreviations are left as written, for the model to read; a
    period after a one-letter word ("J. R. R.", "z. B.") or before a lower-case one ("etc. and") is not
    taken for a sentence's end.
    Empty input gives [].
    """
    if max_chars < 20:
        raise ValueError("max_chars must be >= 20")
    text = normalize(text)
    if not text:
        return []
    pieces: list[str] = []
    for sentence in _sentences(text):
        pieces.extend(_split_long(sentence, max_chars))
    return [m for m in _merge(pieces, max_chars) if m]


def sentences(text: str) -> list[str]:
    """`text` normalised and cut after each sentence end, without merging or splitting: a streamed reply's sentences."""
    return _sentences(normalize(text))


def _sentences(text: str) -> list[str]:
    """`text` cut after each sentence end (marks and closers kept with their sentence), each piece stripped."""
    out: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        rest = text[end:].lstrip()
        if match.group().startswith(".") and (rest[:1].islower() or _INITIAL.search(text, 0, match.start() + 1)):
            continue  # an abbreviation inside a sentence: "z. B. der", "etc. and", "J. R. R. Tolkien"
        if end > start:
            out.append(text[start:end].strip())
        start = end
    out.append(text[start:].strip())
    return [s for s in out if s]


def _joiner(left: str, right: str) -> str:
    """What goes between two pieces put back together: nothing between two full-width characters, else a space."""
    wide = ("W", "F")
    return (
        "" if unicodedata.east_asian_width(left[-1]) in wide and unicodedata.east_asian_width(right[0]) in wide else " "
    )


def _merge(pieces: list[str], max_chars: int) -> list[str]:
    merged: list[str] = []
    for piece in pieces:
        if merged and len(joined := merged[-1] + _joiner(merged[-1], piece) + piece) <= max_chars:
            merged[-1] = joined
        else:
            merged.append(piece)
    return merged


def _split_long(sentence: str, max_chars: int) -> list[str]:
    if len(sentence) <= max_chars:
        return [sentence]
    out: list[str] = []
    for clause in _CLAUSE_END.split(sentence):
        clause = clause.strip()
        while len(clause) > max_chars:
            cut = _cut(clause, max_chars)
            out.append(clause[:cut].strip())
            clause = clause[cut:].strip()
        if clause:
            out.extend(_merge([out.pop(), clause], max_chars) if out else [clause])
    return out


def _cut(clause: str, max_chars: int) -> int:
    """Where to cut a clause longer than `max_chars`: the last space within it, else the last character boundary
    within it that is neither inside an emotion tag nor before a combining mark."""
    cut = clause.rfind(" ", 0, max_chars + 1)
    if cut > 0:
        return cut
    cut = max_chars
    for tag in _TAG.finditer(clause, 0, max_chars + 32):
        if tag.start() < cut < tag.end() and tag.start() > 0:
            cut = tag.start()
    while cut > 1 and unicodedata.category(clause[cut])[0] == "M":
        cut -= 1
    return cut
