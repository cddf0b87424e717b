"""The reference decoding scheme (Canopy's): a 4-frame window decoded whole for every new frame.

The baseline that `bench decoder` and `bench engine --decode-scheme reference` measure the project's
streaming decoder against, behind the same FrameDecoder interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ...codec.codes import frames_to_levels
from ...codec.decoder import DecodeState
from ...codec.snac import to_int16
from ...spec import SAMPLES_PER_FRAME

_NO_AUDIO = np.zeros(0, dtype=np.int16)
_NO_FRAMES = np.zeros((0, 7), dtype=np.int64)


@torch.inference_mode()
def reference_decode(snac: nn.Module, windows: np.ndarray) -> np.ndarray:
    """The reference scheme: decode (B, 4, 7) frame windows whole and keep the second frame (B, 2048)."""
    device = next(snac.parameters()).device
    codes = [torch.from_numpy(c).to(device) for c in frames_to_levels(windows)]
    audio = snac.decode(codes)[:, 0, SAMPLES_PER_FRAME : 2 * SAMPLES_PER_FRAME]
    return to_int16(audio).cpu().numpy()


@dataclass
class _WindowState(DecodeState):
    """A DecodeState that also remembers the last WINDOW - 1 frames (the reference's history)."""

    history: np.ndarray = field(default_factory=lambda: _NO_FRAMES)


class ReferenceDecoder:
    """The reference decoding scheme behind the StreamingDecoder interface, for side-by-side benchmarks.

    Like Canopy's reference: each new frame (from the 4th on) decodes the window of the last 4 frames
    alone, one stream and one window per SNAC call, and emits the window's second frame; the first
    frame and the last two of an utterance are never emitted. Its audio is what the reference plays.
    """

    WINDOW = 4

    def __init__(self, snac: nn.Module):
        self.snac = snac
        self.first_chunk_frames = self.WINDOW
        self.ahead_chunk_frames = 1  # one window per frame whatever is pending: nothing to gain by waiting
        self.calls = 0
        self.frames = 0  # frames run through SNAC: WINDOW per call

    @property
    def device(self) -> torch.device:
        return next(self.snac.parameters()).device

    def new_state(self) -> DecodeState:
        return _WindowState()

    def release(self, state: DecodeState) -> None:
        """Nothing to free: the history lives in the state."""

    def decode(self, states: Sequence[DecodeState]) -> list[np.ndarray | Exception]:
        """Decode every new frame of `states` in its own 4-frame window: new int16 audio of each."""
        out: list[np.ndarray | Exception] = []
        for st in states:
            assert isinstance(st, _WindowState)
            history = st.history  # the last WINDOW - 1 frames
            frames = np.concatenate([history, *st.pending])
            st.pending.clear()
            first_new = max(len(history), self.WINDOW - 1)
            audio = [
                reference_decode(self.snac, frames[None, k - self.WINDOW + 1 : k + 1])[0]
                for k in range(first_new, len(frames))
            ]
            self.calls += len(audio)
            self.frames += self.WINDOW * len(audio)
            st.frames_in += len(frames) - len(history)
            st.history = frames[-(self.WINDOW - 1) :]
            pcm = np.concatenate(audio) if audio else _NO_AUDIO
            out.append(pcm)
            st.samples_out += pcm.size
        return out

    def stats(self) -> dict[str, object]:
        return {"decoded_frames": self.frames, "decoder_calls": self.calls, "decoded_rows": self.calls}
