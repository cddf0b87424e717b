"""SNAC as the decoder loads it: checks at load, weight norm folded, noise fixed by position, edges faded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from orpheus_tts_plugin.codec.snac import FADE_SAMPLES, fade_edges, load_snac, offline_decode, to_int16
from orpheus_tts_plugin.spec import SAMPLES_PER_FRAME


def _frames(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7))


def test_noise_is_a_function_of_position(full_snac) -> None:
    frames = _frames(5, 1)
    assert np.array_equal(offline_decode(full_snac, frames), offline_decode(full_snac, frames))


def test_snac_with_attention_is_refused(tmp_path: Path) -> None:
    from snac import SNAC

    config = {
        "sampling_rate": 24000,
        "encoder_rates": [2, 4, 8, 8],
        "decoder_rates": [8, 8, 4, 2],
        "encoder_dim": 8,
        "decoder_dim": 64,
        "vq_strides": [4, 2, 1],
        "attn_window_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(SNAC(**config).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="attention"):
        load_snac(str(tmp_path))


def test_a_loaded_snac_has_no_weight_norm_left_and_needs_no_gradients(tiny_snac) -> None:
    from torch.nn.utils import parametrize

    assert not any(parametrize.is_parametrized(m) for m in tiny_snac.modules())
    assert not any(p.requires_grad for p in tiny_snac.parameters())


def test_the_offline_decode_is_a_frames_worth_of_int16_samples_a_frame(tiny_snac) -> None:
    audio = offline_decode(tiny_snac, _frames(3, 2))
    assert audio.dtype == np.int16 and audio.shape == (3 * SAMPLES_PER_FRAME,)


def test_an_utterance_fades_in_from_its_start_and_out_to_its_end() -> None:
    audio = torch.ones(1, 4 * FADE_SAMPLES)
    faded = fade_edges(audio.clone(), torch.tensor([0]), torch.tensor([audio.shape[1]]))[0]
    assert faded[0] == 0 and faded[-1] == 0 and faded[FADE_SAMPLES:-FADE_SAMPLES].eq(1).all()
    assert (faded[1:FADE_SAMPLES] > 0).all() and (faded[: FADE_SAMPLES + 1].diff() >= 0).all()
    middle = fade_edges(audio.clone(), torch.tensor([FADE_SAMPLES]), None)[0]  # past the start, end unknown
    assert middle.eq(1).all()


def test_samples_beyond_full_scale_are_clipped_into_int16() -> None:
    assert to_int16(torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])).tolist() == [-32768, -32767, 0, 32767, 32767]
