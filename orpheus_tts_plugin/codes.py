"""Audio token ids → complete 7-token SNAC frames, phase-checked; bad ids are counted, never fatal."""

from __future__ import annotations

import collections

import numpy as np

from .spec import CODEBOOK_SIZE, LEVEL_POSITIONS, TOKENS_PER_FRAME, ModelSpec

_POSITION_OFFSETS = np.arange(TOKENS_PER_FRAME, dtype=np.int64) * CODEBOOK_SIZE


class FrameParser:
    """Turns one utterance's stream of generated ids into frames of 7 codes (0…4095).

    Valid runs are handled in one vectorised pass; any anomaly (a non-audio id, an audio id for
    the wrong frame position, an end-of-speech id inside a frame) drops the partial frame and
    resumes at the next id that can start a frame. Anomalies are counted in `errors`.
    """

    def __init__(self, spec: ModelSpec):
        self._base = spec.first_audio_token
        self._span = TOKENS_PER_FRAME * CODEBOOK_SIZE
        self._end = spec.end_of_speech
        self._partial = np.empty(TOKENS_PER_FRAME, dtype=np.int64)
        self._n_partial = 0
        self.ended = False
        self.frames_out = 0
        self.errors: collections.Counter[str] = collections.Counter()

    def feed(self, ids: object) -> np.ndarray:
        """Consume new ids; return the frames they complete as an int64 array (n, 7) of codes."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0 or self.ended:
            return _EMPTY
        rel = arr - self._base
        phase = (self._n_partial + np.arange(arr.size)) % TOKENS_PER_FRAME
        ok = (rel >= 0) & (rel < self._span) & (rel // CODEBOOK_SIZE == phase)
        if ok.all():
            return self._take(rel - _POSITION_OFFSETS[phase])
        return self._feed_slow(arr)

    def _take(self, codes: np.ndarray) -> np.ndarray:
        """Append phase-correct codes; return the frames completed."""
        n_total = self._n_partial + codes.size
        n_frames = n_total // TOKENS_PER_FRAME
        if n_frames == 0:
            self._partial[self._n_partial : n_total] = codes
            self._n_partial = n_total
            return _EMPTY
        joined = np.concatenate([self._partial[: self._n_partial], codes])
        frames = joined[: n_frames * TOKENS_PER_FRAME].reshape(n_frames, TOKENS_PER_FRAME)
        rest = joined[n_frames * TOKENS_PER_FRAME :]
        self._partial[: rest.size] = rest
        self._n_partial = rest.size
        self.frames_out += n_frames
        return frames

    def _feed_slow(self, arr: np.ndarray) -> np.ndarray:
        """Token by token, for runs that contain an anomaly (rare)."""
        out: list[np.ndarray] = []
        for token in arr.tolist():
            if token == self._end:
                if self._n_partial:
                    self.errors["end_inside_frame"] += 1
                    self._n_partial = 0
                self.ended = True
                break
            rel = token - self._base
            if not 0 <= rel < self._span:
                self.errors["non_audio_id"] += 1
                self._n_partial = 0
                continue
            position = rel // CODEBOOK_SIZE
            if position != self._n_partial:
                self.errors["wrong_position"] += 1
                self._n_partial = 0
                if position != 0:
                    continue
            frames = self._take(np.array([rel - position * CODEBOOK_SIZE], dtype=np.int64))
            if frames.size:
                out.append(frames)
        return np.concatenate(out) if out else _EMPTY

    @property
    def pending_tokens(self) -> int:
        """Ids of an incomplete frame held back."""
        return self._n_partial


_EMPTY = np.empty((0, TOKENS_PER_FRAME), dtype=np.int64)


def frames_to_levels(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(..., n, 7) frames → SNAC codes per level: (..., n), (..., 2n), (..., 4n) in time order."""
    lead = frames.shape[:-2]
    return tuple(frames[..., list(pos)].reshape(*lead, -1) for pos in LEVEL_POSITIONS)  # type: ignore[return-value]


def ids_to_frames(ids: object, spec: ModelSpec) -> tuple[np.ndarray, FrameParser]:
    """Parse a whole saved id sequence at once (the parser that the engine feeds step by step)."""
    parser = FrameParser(spec)
    return parser.feed(ids), parser
