"""SNAC's decoder as streaming layers: the mirror of its layers, its weights left alone, shapes refused, and no
kernel cliff.

A kernel cliff on a new host or torch release is caught here, not by a caller: each decoder layer with weights,
at its steady shape, against its matmul equivalent on the same host (a ratio, never a time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from orpheus_tts_plugin.codec.layers import _Conv, _ConvTranspose, build_layers
from orpheus_tts_plugin.tools.bench.layers import CLIFF_RATIO, profile


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
    from orpheus_tts_plugin.codec.decoder import StreamingDecoder

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


# ------------------------------------------------------------------ kernel cliffs
ATTEMPTS = 3  # a layer must be over the ratio in every attempt: a noisy neighbour slows one, a cliff all


def _cliffs(snac, rows: int) -> dict[str, float]:
    table = profile(snac, rows, calls=9, reference=False)
    return {f"{r['layer']} {r['kind']} {r['input']}": r["ratio"] for r in table if r.get("ratio", 0) > CLIFF_RATIO}


@pytest.mark.parametrize("rows", [1, 8])
def test_no_decoder_layer_is_more_than_5x_its_matmul_equivalent(full_snac, rows: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's decoder thread runs on CPU
    try:
        over = _cliffs(full_snac, rows)
        for _ in range(ATTEMPTS - 1):
            if not over:
                break
            again = _cliffs(full_snac, rows)
            over = {k: max(v, again[k]) for k, v in over.items() if k in again}
    finally:
        torch.set_num_threads(threads)
    assert not over, f"layers over {CLIFF_RATIO}x their matmul equivalent on this host: {over}"


def test_every_layer_with_weights_is_guarded(full_snac) -> None:
    kinds = {r["kind"] for r in profile(full_snac, 1, calls=1, reference=False) if "ratio" in r}
    assert kinds == {"Conv", "Pointwise", "ConvTranspose", "Noise"}
