"""FixedWeight: the packed oneDNN product is the same product as torch.mm, used only where it is meant to be."""

from __future__ import annotations

import pytest
import torch

from orpheus_tts_plugin.codec.gemm import PACKED_MAX_COLUMNS, PACKED_MIN_ELEMENTS, FixedWeight


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(1024, 768, generator=torch.Generator().manual_seed(0)) / 768**0.5


@pytest.mark.parametrize("columns", [1, 5, PACKED_MAX_COLUMNS, PACKED_MAX_COLUMNS + 1, 200])
def test_every_column_count_gives_the_plain_product(weight: torch.Tensor, columns: int) -> None:
    x = torch.randn(768, columns, generator=torch.Generator().manual_seed(columns))
    y = FixedWeight(weight)(x)
    assert y.shape == (1024, columns) and y.is_contiguous()
    torch.testing.assert_close(y, weight @ x, rtol=1e-4, atol=1e-5)


def test_the_packed_weight_serves_only_large_weights_at_few_columns(weight: torch.Tensor) -> None:
    big = FixedWeight(weight)
    if big.packed is None:
        pytest.skip("this torch build has no oneDNN packed linear")
    assert weight.numel() >= PACKED_MIN_ELEMENTS
    assert big.uses_packed(1) and big.uses_packed(PACKED_MAX_COLUMNS) and not big.uses_packed(PACKED_MAX_COLUMNS + 1)
    assert FixedWeight(torch.randn(256, 256)).packed is None  # small: torch.mm is as fast
    assert FixedWeight(weight, packed=False).packed is None  # a compiled step traces plain ops


def test_a_decoder_built_for_compilation_packs_nothing(full_snac_dir) -> None:
    from orpheus_tts_plugin.codec.decoder import StreamingDecoder
    from orpheus_tts_plugin.codec.snac import load_snac

    snac = load_snac(str(full_snac_dir))
    eager, compiled = StreamingDecoder(snac, max_streams=1), StreamingDecoder(snac, max_streams=1, compile=True)
    can_pack = FixedWeight(torch.randn(1024, 768)).packed is not None
    assert any(g.packed is not None for g in _gemms(eager.layers)) == can_pack
    assert all(g.packed is None for g in _gemms(compiled.layers))


def _gemms(layers: list) -> list[FixedWeight]:
    """Every fixed-weight product of the layers, residual blocks' inner layers included."""
    out = []
    for layer in layers:
        out += ([layer.gemm] if hasattr(layer, "gemm") else []) + _gemms(getattr(layer, "layers", []))
    return out
