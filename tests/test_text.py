"""Input text: normalized, then split into sentences at bounds, clauses or spaces, through the public functions."""

from __future__ import annotations

from orpheus_tts_plugin.text import normalize, split_sentences


def test_normalize_removes_control_characters_and_keeps_tags() -> None:
    text = "Hello\x00 there\x07,\u200b friend <laugh>\tyes\r\nno"
    assert normalize(text) == "Hello there, friend <laugh> yes no"


def test_empty_and_whitespace_text_has_no_sentences() -> None:
    assert split_sentences("") == []
    assert split_sentences(" \n\t \x00") == []


def test_long_text_splits_at_sentence_bounds_in_order() -> None:
    sentences = [f"This is sentence number {i} and it says something <sigh> long enough." for i in range(12)]
    pieces = split_sentences(" ".join(sentences), max_chars=150)
    assert len(pieces) > 1
    assert all(len(p) <= 150 for p in pieces)
    assert " ".join(pieces) == " ".join(sentences)
    assert all(p.endswith(".") for p in pieces)


def test_a_sentence_longer_than_the_limit_is_split_at_clauses_then_spaces() -> None:
    words = " ".join(f"word{i}," for i in range(80))
    pieces = split_sentences(words, max_chars=60)
    assert all(0 < len(p) <= 60 for p in pieces)
    assert " ".join(pieces) == words
