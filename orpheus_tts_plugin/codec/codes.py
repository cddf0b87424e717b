"""Audio token ids → complete 7-token SNAC frames, phase-checked; bad ids are counted, never fatal."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from ..spec import CODEBOOK_SIZE, LEVEL_POSITIONS, TOKENS_PER_FRAME, ModelSpec

_POSITION_OFFSETS = np.arange(TOKENS_PER_FRAME, dtype=np.int64) * CODEBOOK_SIZE


class FrameParser:
    """Turns one utterance's stream of generated ids into frames of 7 codes (0…4095).

    Long runs of valid ids are checked in one vectorised pass; short runs (one engine step
    usually brings one id) take a plain integer path, cheaper than any numpy call. Any anomaly
    (a non-audio id, an audio id for the wrong frame position, an end-of-speech id inside a
    frame) drops the partial frame and resumes at the next id that can start a frame.
    Anomalies are counted in `errors`.
    """

    VECTOR_MIN = 32  # ids per feed from which the numpy path is cheaper

    def __init__(self, spec: ModelSpec):
        self._base = spec.first_audio_token
        self._span = TOKENS_PER_FRAME * CODEBOOK_SIZE
        self._end = spec.end_of_speech
        self._partial: list[int] = []
        self.ended = False
        self.frames_out = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def feed(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Consume new ids; return the frames they complete as an int64 array (n, 7) of codes."""
        if self.ended or len(ids) == 0:
            return _EMPTY
        if len(ids) >= self.VECTOR_MIN:
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            rel = arr - self._base
            phase = (len(self._partial) + np.arange(arr.size)) % TOKENS_PER_FRAME
            if ((rel >= 0) & (rel < self._span) & (rel // CODEBOOK_SIZE == phase)).all():
                return self._take(rel - _POSITION_OFFSETS[phase])
        return self._feed_ids(ids)

    def _take(self, codes: np.ndarray) -> np.ndarray:
        """Append a phase-correct run of codes; return the frames completed."""
        joined = np.concatenate([np.asarray(self._partial, dtype=np.int64), codes])
        n_frames = joined.size // TOKENS_PER_FRAME
        cut = n_frames * TOKENS_PER_FRAME
        self._partial = joined[cut:].tolist()
        self.frames_out += n_frames
        return joined[:cut].reshape(n_frames, TOKENS_PER_FRAME)

    def _feed_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Id by id, with integer arithmetic: short runs, and runs that contain an anomaly."""
        frames: list[list[int]] = []
        partial = self._partial
        for token in ids:
            rel = int(token) - self._base - len(partial) * CODEBOOK_SIZE
            if 0 <= rel < CODEBOOK_SIZE:
                partial.append(rel)
                if len(partial) == TOKENS_PER_FRAME:
                    frames.append(partial)
                    partial = []
                continue
            if token == self._end:
                if partial:
                    self.errors["end_inside_frame"] += 1
                    partial = []
                self.ended = True
                break
            position = (int(token) - self._base) // CODEBOOK_SIZE
            if not 0 <= position < TOKENS_PER_FRAME:
                self.errors["non_audio_id"] += 1
                partial = []
                continue
            self.errors["wrong_position"] += 1
            partial = []
            if position == 0:
                partial.append(int(token) - self._base)
        self._partial = partial
        if not frames:
            return _EMPTY
        self.frames_out += len(frames)
        return np.array(frames, dtype=np.int64)


_EMPTY = np.empty((0, TOKENS_PER_FRAME), dtype=np.int64)


def frames_to_levels(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(..., n, 7) frames (numpy or torch) → SNAC codes per level: (..., n), (..., 2n), (..., 4n) in time order."""
    lead = frames.shape[:-2]
    return tuple(frames[..., list(pos)].reshape(*lead, -1) for pos in LEVEL_POSITIONS)  # type: ignore[return-value]


def levels_to_frames(levels: Sequence[np.ndarray]) -> np.ndarray:
    """SNAC codes per level, (n,), (2n,), (4n,) in time order → (n, 7) frames: the inverse of `frames_to_levels`."""
    n = len(levels[0])
    frames = np.empty((n, TOKENS_PER_FRAME), dtype=np.int64)
    for level, positions in enumerate(LEVEL_POSITIONS):
        codes = np.asarray(levels[level], dtype=np.int64)
        if codes.shape != (n * len(positions),):
            raise ValueError(f"SNAC level {level}: expected {n * len(positions)} codes, got shape {codes.shape}")
        frames[:, list(positions)] = codes.reshape(n, len(positions))
    return frames
