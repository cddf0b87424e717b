"""Input text: normalized, then split into sentences at bounds, clauses or spaces, through the public functions."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin.speech.text import normalize, split_sentences


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


# ---------------------------------------------------------------------------------------------- splitting
# Real sentences in each script; max_chars small enough that the sentence bounds show, pieces merged up to it.
SPLITS = {
    "fr": (
        "Bonjour, je m'appelle Marie. Comment allez-vous aujourd'hui ? Il fait très beau à Paris !",
        40,
        ["Bonjour, je m'appelle Marie.", "Comment allez-vous aujourd'hui ?", "Il fait très beau à Paris !"],
    ),
    "de": (  # "z. B." and "3,5" stay as written and do not end a sentence
        "Das Wetter ist heute z. B. sehr schön. Wir gehen 3,5 km spazieren. Kommst du mit?",
        40,
        ["Das Wetter ist heute z. B. sehr schön.", "Wir gehen 3,5 km spazieren.", "Kommst du mit?"],
    ),
    "es": (
        "¿Cómo estás? ¡Muy bien, gracias! Nos vemos mañana a las 3.30 en la plaza.",
        45,
        ["¿Cómo estás? ¡Muy bien, gracias!", "Nos vemos mañana a las 3.30 en la plaza."],
    ),
    "it": (
        "Ciao, come stai? Sto bene, grazie. Andiamo al mare domani mattina con gli amici.",
        35,
        ["Ciao, come stai? Sto bene, grazie.", "Andiamo al mare domani mattina con", "gli amici."],
    ),
    "zh": (  # no spaces after 。！？ and none put back between Chinese sentences
        "今天天气很好。我们去公园散步吧！你想一起来吗？「好啊。」他说。",
        20,
        ["今天天气很好。我们去公园散步吧！", "你想一起来吗？「好啊。」他说。"],
    ),
    "ko": (
        "안녕하세요. 오늘 날씨가 정말 좋네요. 공원에 산책하러 갈까요? 네, 좋아요!",
        20,
        ["안녕하세요.", "오늘 날씨가 정말 좋네요.", "공원에 산책하러 갈까요?", "네, 좋아요!"],
    ),
    "hi": (
        "मैं आज बाज़ार गया। वहाँ बहुत भीड़ थी॥ क्या तुम कल मेरे साथ चलोगे?",
        30,
        ["मैं आज बाज़ार गया।", "वहाँ बहुत भीड़ थी॥", "क्या तुम कल मेरे साथ चलोगे?"],
    ),
    "ar": ("هل أنت بخير؟ نعم، أنا بخير شكرا لك.", 24, ["هل أنت بخير؟", "نعم، أنا بخير شكرا لك."]),
}


@pytest.mark.parametrize("language", sorted(SPLITS))
def test_sentences_split_at_each_scripts_own_marks(language: str) -> None:
    text, max_chars, pieces = SPLITS[language]
    assert split_sentences(text, max_chars) == pieces


def test_a_long_chinese_sentence_splits_at_full_width_clause_marks_then_between_characters() -> None:
    text = "这是一个很长的句子，里面有很多逗号，还有一些顿号、分号；以及冒号：最后才结束。"
    assert split_sentences(text, 20) == [
        "这是一个很长的句子，里面有很多逗号，",
        "还有一些顿号、分号；以及冒号：",
        "最后才结束。",
    ]
    unbroken = "我们明天早上八点在学校门口见面" * 5 + "<laugh>" + "然后一起去图书馆看书" * 3
    pieces = split_sentences(unbroken, 24)
    assert "".join(pieces) == unbroken and all(len(p) <= 24 for p in pieces)
    assert any(p.startswith("<laugh>") or p.endswith("<laugh>") or "<laugh>" in p for p in pieces)  # never cut


def test_a_long_hindi_word_run_is_never_cut_before_a_combining_mark() -> None:
    text = "क्या" * 30  # each क्या is consonant + virama + consonant + vowel sign, no spaces
    pieces = split_sentences(text, 21)
    assert "".join(pieces) == text
    assert all(p[0] not in "\u094d\u093e" for p in pieces)  # no piece starts with a virama or a vowel sign
