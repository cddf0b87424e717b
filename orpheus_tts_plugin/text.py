"""Input text: validation, normalisation and sentence splitting; emotion tags like <laugh> are kept."""

from __future__ import annotations

import re
import unicodedata

_SPACE = re.compile(r"\s+")
# A sentence ends at . ! ? … (possibly followed by closing quotes/brackets) and whitespace.
_SENTENCE_END = re.compile(r"(?<=[.!?…])[\"'”’)\]]*\s+")
_CLAUSE_END = re.compile(r"(?<=[,;:—–])\s+")


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
    longer than that is split at clause marks, then at spaces. Empty input gives [].
    """
    if max_chars < 20:
        raise ValueError("max_chars must be >= 20")
    text = normalize(text)
    if not text:
        return []
    pieces: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        pieces.extend(_split_long(sentence.strip(), max_chars))
    merged: list[str] = []
    for piece in pieces:
        if merged and len(merged[-1]) + 1 + len(piece) <= max_chars:
            merged[-1] = f"{merged[-1]} {piece}"
        else:
            merged.append(piece)
    return [m for m in merged if m]


def _split_long(sentence: str, max_chars: int) -> list[str]:
    if len(sentence) <= max_chars:
        return [sentence]
    out: list[str] = []
    for clause in _CLAUSE_END.split(sentence):
        while len(clause) > max_chars:
            cut = clause.rfind(" ", 0, max_chars + 1)
            if cut <= 0:
                cut = max_chars
            out.append(clause[:cut].strip())
            clause = clause[cut:].strip()
        if clause:
            if out and len(out[-1]) + 1 + len(clause) <= max_chars:
                out[-1] = f"{out[-1]} {clause}"
            else:
                out.append(clause)
    return out
