"""Input handling, prompt ids and the frame parser, through their public functions."""

from __future__ import annotations

import numpy as np
import pytest

from orpheus_tts_plugin.codes import FrameParser, frames_to_levels
from orpheus_tts_plugin.prompt import prompt_ids, token_budget
from orpheus_tts_plugin.spec import ENGLISH
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


class _Tok:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ENGLISH.bos, *(ord(c) for c in text)]}


def test_prompt_ids_layout_has_one_bos() -> None:
    ids = prompt_ids(_Tok(), ENGLISH, "Hi", "tara")
    assert ids[0] == ENGLISH.start_of_human
    assert ids[1] == ENGLISH.bos and ids.count(ENGLISH.bos) == 1
    assert "".join(map(chr, ids[2:-4])) == "tara: Hi"
    assert ids[-4:] == (128009, 128260, 128261, 128257)


def test_token_budget_names_the_limit_that_applies() -> None:
    assert token_budget("hello", per_char=10, base=100, max_tokens=6144) == (154, "budget")
    assert token_budget("hello", per_char=10, base=100, max_tokens=100) == (100, "max_tokens")


def test_unknown_voice_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="tara.*leah.*zoe"):
        ENGLISH.check_voice("nobody")


def _ids(frames: np.ndarray) -> list[int]:
    return [ENGLISH.audio_token(k, int(c)) for f in frames for k, c in enumerate(f)]


@pytest.mark.parametrize("step", [1, 2, 7, 33, 1000])
def test_parser_returns_every_frame_whatever_the_step_size(step: int) -> None:
    frames = np.random.default_rng(step).integers(0, 4096, size=(20, 7))
    frames[3] = 0  # code 0 is valid (the reference drops it and loses the phase)
    ids = _ids(frames)
    parser = FrameParser(ENGLISH)
    got = [parser.feed(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert np.array_equal(np.concatenate(got), frames)
    assert not parser.errors


def test_parser_counts_bad_ids_and_resumes_at_the_next_frame() -> None:
    frames = np.random.default_rng(0).integers(0, 4096, size=(6, 7))
    ids = _ids(frames)
    bad = (
        ids[0:3]
        + [ENGLISH.pad]  # non-audio id inside frame 0
        + ids[7:10]
        + [ENGLISH.audio_token(5, 1)]  # wrong position inside frame 1
        + ids[14:21]  # frame 2, complete
        + [ENGLISH.first_audio_token + 7 * 4096]  # past the last audio id
        + [ENGLISH.audio_token(0, 4096)]  # "code 4096" is position 1: wrong position
        + ids[21:28]  # frame 3, complete
        + ids[28:32]
        + [ENGLISH.end_of_speech]  # end inside frame 4
        + ids[35:42]  # after the end: ignored
    )
    parser = FrameParser(ENGLISH)
    got = np.concatenate([parser.feed(bad[i : i + 5]) for i in range(0, len(bad), 5)])
    assert np.array_equal(got, frames[[2, 3]])
    assert parser.errors == {"non_audio_id": 2, "wrong_position": 2, "end_inside_frame": 1}
    assert parser.ended


def test_frames_to_levels_follows_the_orpheus_layout() -> None:
    frames = np.arange(14).reshape(2, 7)
    c0, c1, c2 = frames_to_levels(frames)
    assert c0.tolist() == [0, 7]
    assert c1.tolist() == [1, 4, 8, 11]
    assert c2.tolist() == [2, 3, 5, 6, 9, 10, 12, 13]
