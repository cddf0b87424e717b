"""SNAC's decoder as streaming layers: the mirror of its layers, its weights left alone, shapes refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from orpheus_tts_plugin.layers import _Conv, _ConvTranspose, build_layers


def _snac_layers(snac: nn.Module) -> list[nn.Module]:
    """SNAC's decoder layers with its decoder blocks opened up, as build_layers walks them."""
    from snac.layers import DecoderBlock

    return [s for m in snac.decoder.model for s in (m.block if isinstance(m, DecoderBlock) else [m])]


def test_the_layers_mirror_snacs_decoder_less_its_final_tanh(tiny_snac) -> None:
    theirs = _snac_layers(tiny_snac)
    assert isinstance(theirs[-1], nn.Tanh)  # applied by the decoder's step
    assert len(build_layers(tiny_snac)) == len(theirs) - 1


@pytest.mark.parametrize("packed", [True, False])
def test_building_and_running_the_layers_leaves_snacs_weights_as_they_were(tiny_snac, packed: bool) -> None:
    from orpheus_tts_plugin.decoder import StreamingDecoder

    before = {k: v.clone() for k, v in tiny_snac.state_dict().items()}
    decoder = StreamingDecoder(tiny_snac, max_streams=1)
    state = decoder.new_state()
    state.pending.append(torch.randint(0, 4096, (6, 7), generator=torch.Generator().manual_seed(1)).numpy())
    state.final = True
    while not state.done:
        decoder.decode([state])
    build_layers(tiny_snac, packed=packed)
    after = tiny_snac.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_convolution_without_same_padding_is_refused() -> None:
    with pytest.raises(ValueError, match="stride-1, symmetric 'same' padding"):
        _Conv(nn.Conv1d(4, 4, kernel_size=3, padding=0), per_frame=4, delay=0)


def test_a_transposed_convolution_whose_kernel_is_not_twice_its_stride_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel 2·stride"):
        _ConvTranspose(nn.ConvTranspose1d(4, 4, kernel_size=3, stride=2), per_frame=4, delay=0, packed=False)


def test_an_unknown_layer_in_snacs_decoder_is_refused() -> None:
    snac = SimpleNamespace(decoder=SimpleNamespace(model=[nn.ReLU()]))
    with pytest.raises(ValueError, match="unexpected SNAC decoder layer ReLU"):
        build_layers(snac)  # type: ignore[arg-type]
