"""SNAC 24 kHz: loading, noise made a function of absolute position, and the offline whole-utterance decode.

SNAC's NoiseBlock draws fresh noise on every call; `load_snac` replaces it by noise from a fixed table
indexed by absolute sample position, so that a streamed decode and an offline decode of the same codes agree.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ..spec import SAMPLE_RATE, SAMPLES_PER_FRAME
from ..weights import SNAC as SNAC_FOLDER
from ..weights import load_error, require_weights
from .codes import frames_to_levels

LATENT_PER_FRAME = 4  # SNAC latent steps (hop 512) per 2,048-sample frame
FADE_SAMPLES = 240  # 10 ms fade at each end of an utterance
NOISE_PERIOD_FRAMES = 1024  # noise repeats after this many frames (87 s), longer than any utterance
# Look-ahead of the SNAC 24 kHz decoder in samples (what the streaming decoder measures from its layers).
SNAC24_LATENCY = 4757


def load_snac(
    path_or_repo: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, noise_seed: int = 0
) -> nn.Module:
    """Load a SNAC 24 kHz model (hub id or local dir) with position-seeded noise, in eval mode; ModelLoadError in
    one line, before anything loads, for a folder that holds no SNAC or a hub id neither cached nor reachable."""
    from snac import SNAC

    require_weights("SNAC", path_or_repo, SNAC_FOLDER)
    try:
        model = SNAC.from_pretrained(path_or_repo)
    except OSError as exc:  # what the hub client raises; its message is a paragraph
        raise load_error("SNAC", path_or_repo, exc) from exc
    if model.sampling_rate != SAMPLE_RATE or model.hop_length * LATENT_PER_FRAME != SAMPLES_PER_FRAME:
        raise ValueError(
            f"{path_or_repo}: Orpheus needs the 24 kHz SNAC (hop 512), got "
            f"{model.sampling_rate} Hz, hop {model.hop_length}"
        )
    if model.attn_window_size is not None:
        raise ValueError(f"{path_or_repo}: a SNAC decoder with local attention cannot stream exactly")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    remove_weight_norm(model)
    make_noise_deterministic(model, noise_seed)
    return model


def remove_weight_norm(model: nn.Module) -> None:
    """Fold every weight-norm parametrisation into a plain weight (in place).

    SNAC's layers are weight-normed; left parametrised, each forward (the quantizer's projections in every
    decoder call among them) recomputes `g · v / ‖v‖`. The weights are fixed at inference, so fold them once.
    """
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)


class PositionalNoise(nn.Module):
    """SNAC's NoiseBlock with noise drawn from a fixed table indexed by absolute sample position."""

    def __init__(self, linear: nn.Module, table: Tensor):
        super().__init__()
        self.linear = linear
        self.register_buffer("table", table, persistent=False)

    def noise(self, positions: Tensor) -> Tensor:
        return self.table[positions.remainder(self.table.numel())]

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            positions = torch.arange(x.shape[-1], device=x.device)
        return x + self.noise(positions).unsqueeze(-2) * self.linear(x)


def make_noise_deterministic(model: nn.Module, seed: int = 0) -> None:
    """Replace every NoiseBlock of a SNAC decoder by a PositionalNoise (in place)."""
    from snac.layers import DecoderBlock, NoiseBlock

    rate = 1
    blocks = [m for m in model.decoder.model if isinstance(m, DecoderBlock)]
    for i, block in enumerate(blocks):
        convt = block.block[1]
        rate *= convt.stride[0]
        for j, layer in enumerate(block.block):
            if isinstance(layer, NoiseBlock):
                gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
                length = NOISE_PERIOD_FRAMES * LATENT_PER_FRAME * rate
                table = torch.randn(length, generator=gen).to(next(model.parameters()))
                block.block[j] = PositionalNoise(layer.linear, table)


def fade_edges(audio: Tensor, start: Tensor, total: Tensor | None) -> Tensor:
    """Linear fades over the first and last FADE_SAMPLES of an utterance.

    `audio` (B, n) holds samples from absolute position `start` (B,); `total` (B,) is the
    utterance length where known (its end is in this chunk), else None or negative.
    """
    pos = start.unsqueeze(1) + torch.arange(audio.shape[-1], device=audio.device)
    gain = (pos.to(audio.dtype) / FADE_SAMPLES).clamp(max=1.0)
    if total is not None:
        tail = ((total.unsqueeze(1) - 1 - pos).to(audio.dtype) / FADE_SAMPLES).clamp(max=1.0)
        gain = torch.where(total.unsqueeze(1) >= 0, torch.minimum(gain, tail), gain)
    return audio * gain.clamp(min=0.0)


def to_int16(audio: Tensor) -> Tensor:
    """Float audio in [-1, 1] → int16, on the audio's device."""
    return (audio * 32767.0).round_().clamp_(-32768, 32767).to(torch.int16)


@torch.inference_mode()
def offline_decode(snac: nn.Module, frames: np.ndarray) -> np.ndarray:
    """Decode a whole utterance at once with SNAC's own decoder: int16, 2,048 samples per frame."""
    if len(frames) == 0:
        return np.zeros(0, dtype=np.int16)
    device = next(snac.parameters()).device
    codes = [torch.from_numpy(c).to(device).unsqueeze(0) for c in frames_to_levels(frames)]
    audio = snac.decode(codes)[:, 0]
    n = audio.shape[-1]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    audio = fade_edges(audio, zero, torch.full((1,), n, device=device))
    return to_int16(audio)[0].cpu().numpy()
