"""The frame parser and the frames-to-SNAC-levels layout, through their public functions."""

from __future__ import annotations

import numpy as np
import pytest

from orpheus_tts_plugin.codec.codes import FrameParser, frames_to_levels
from orpheus_tts_plugin.spec import ENGLISH


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
