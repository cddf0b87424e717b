"""A kernel cliff on a new host or torch release is caught here, not by a caller: each decoder layer with
weights, at its steady shape, against its matmul equivalent on the same host (a ratio, never a time)."""

from __future__ import annotations

import pytest
import torch

from orpheus_tts_plugin.tools.bench.layers import CLIFF_RATIO, profile

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
