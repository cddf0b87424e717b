"""Products with a weight fixed at load: oneDNN with the weight packed once where BLAS falls off at few columns.

The streaming decoder multiplies large weights by a few new columns a call (SNAC's first upsampling layer:
8,192 × 1,024 by 5 columns at one stream). At such skinny shapes `torch.mm` (MKL) is far from the weight-read
bound on some hosts: on an AMD EPYC (MKL 2024.2, AVX2) it took 12.9 ms where oneDNN, with the weight reordered
once into its own layout, took 2.9 ms (reading the weight alone takes ~2.4 ms there); on a Sapphire Rapids
Xeon 2.6 against 1.6 ms. From a few dozen columns on, `torch.mm` is as fast or faster on both. Timing the
formulations at load picked differently from run to run (a win timed alone is often lost among the other
layers), so the rule below is fixed: the same product, formulation and rounding on every run of a host.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

PACKED_MIN_ELEMENTS = 1 << 19  # SNAC's 1024x768, 4096x512 and 8192x1024 products; smaller ones gain nothing
PACKED_MAX_COLUMNS = 32  # measured: the packed product wins up to here on both hosts (docs/benchmarks.md)


def onednn_pack(weight: Tensor) -> Tensor | None:
    """The weight in oneDNN's own layout for `_linear_pointwise`, or None where this torch has no such op."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = packed_product(probe, packed)
    except (AttributeError, RuntimeError, NotImplementedError):  # an op renamed or missing in this torch build
        return None
    want = probe @ weight.t()
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        log.warning("oneDNN's packed product disagrees with torch.mm here; not used")
        return None
    return packed


class FixedWeight:
    """y = weight @ x for a weight (out, in) fixed at load and x (in, N): packed oneDNN at few columns, else mm.

    packed=False (a compiled step, which traces plain ops) always uses `torch.mm`.
    """

    def __init__(self, weight: Tensor, *, packed: bool = True):
        self.weight = weight.contiguous()
        self.out_features, self.in_features = self.weight.shape
        big = self.weight.numel() >= PACKED_MIN_ELEMENTS
        self.packed = onednn_pack(self.weight) if packed and big else None

    def uses_packed(self, columns: int) -> bool:
        """Whether a product with `columns` columns runs on the packed weight."""
        return self.packed is not None and columns <= PACKED_MAX_COLUMNS

    def __call__(self, x: Tensor) -> Tensor:
        """The product (out, N), contiguous."""
        if not self.uses_packed(x.shape[1]):
            return torch.mm(self.weight, x)
        return packed_product(x.t().contiguous(), self.packed).t().contiguous()


def packed_product(rows: Tensor, packed: Tensor) -> Tensor:
    """rows (N, in) @ weight.T with the weight as `onednn_pack` returned it."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
