"""The decoder thread's hold: frames wait while their stream is ahead, never for a first chunk or an end."""

from __future__ import annotations

import math

import numpy as np

from orpheus_tts_plugin.codec.decoder import DecodeState
from orpheus_tts_plugin.engine.decode_worker import held_until
from orpheus_tts_plugin.spec import SAMPLE_RATE


def test_frames_wait_only_while_their_stream_is_ahead_and_never_for_a_first_chunk_or_an_end() -> None:
    def state(frames_in: int, pending: int, final: bool = False) -> DecodeState:
        return DecodeState(frames_in=frames_in, final=final, pending=[np.zeros((pending, 7), np.int64)])

    second = SAMPLE_RATE  # one second of audio delivered, its first at t = 100
    assert held_until(state(4, 1), 100.0, second, 0.5, 4) == 100.5  # ahead until 0.5 s before it runs out
    assert held_until(state(4, 3), 100.0, second, 0.5, 4) == 100.5
    assert held_until(state(4, 4), 100.0, second, 0.5, 4) == -math.inf  # enough frames for one call
    assert held_until(state(0, 2), None, 0, 0.5, 4) == -math.inf  # a first chunk
    assert held_until(state(4, 1, final=True), 100.0, second, 0.5, 4) == -math.inf  # the utterance's end
    assert held_until(state(4, 1), 100.0, second, math.inf, 4) == -math.inf  # holding turned off
