"""`orpheus-tts bench layers`: each streaming decoder layer's time per call at its steady shape, beside a matmul.

A steady call gives each row one new frame. Every layer with weights is timed beside its matmul
equivalent: one GEMM with the same weight elements and the same multiply-adds (a dense convolution of
weight (out, in, k) over L outputs ↔ (out, in · k) @ (in · k, rows · L)); a depthwise convolution, which
has no GEMM in it, beside its k shifted multiply-adds. A layer of n aten operators is never expected to
beat n tiny ones, so the denominator is the larger of the equivalent and n tiny GEMMs. The ratio is a
property of the host's kernels, not of its speed: a kernel cliff (SNAC's first transposed convolution took
24× its matmul as `conv_transpose1d` on an AMD EPYC) shows as a large ratio on any host, and
`tests/test_layers.py` fails on it. Layers that left `F.conv1d`/`F.conv_transpose1d` for a GEMM
formulation are also timed as the call they replaced, side by side.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .common import median_ms, print_rows, run_metadata, write_json

CLIFF_RATIO = 5.0  # a layer slower than this many times its equivalent has hit a kernel cliff


def flat_layers(layers: list[Any]) -> list[tuple[str, Any]]:
    """(name, layer) of every layer, residual units opened into their inner layers ("5.1" = unit 5, layer 1)."""
    from ...codec.layers import _Residual

    out: list[tuple[str, Any]] = []
    for i, layer in enumerate(layers):
        if isinstance(layer, _Residual):
            out += [(f"{i}.{j}", inner) for j, inner in enumerate(layer.layers)]
        else:
            out.append((str(i), layer))
    return out


def gemm_shape(layer: Any, rows: int, n: int) -> tuple[int, int, int] | None:
    """(M, K, N) of the layer's matmul equivalent on `rows` rows of `n` new inputs; None if it has no GEMM."""
    from ...codec.layers import _Conv, _ConvTranspose, _Noise, _Pointwise

    if isinstance(layer, _ConvTranspose):
        return layer.gemm.out_features, layer.in_channels, rows * (n + 1)
    if isinstance(layer, (_Pointwise, _Noise)):
        return layer.gemm.out_features, layer.in_channels, rows * n
    if isinstance(layer, _Conv) and layer.groups == 1:
        out, per_group, k = layer.weight.shape
        return out, per_group * k, rows * n
    return None


def shifted_mac_call(layer: Any, rows: int) -> Callable[[], Any]:
    """A depthwise convolution's equivalent: one multiply-add of a shifted input view per kernel tap."""
    import torch

    taps = layer.weight.shape[-1]
    n, d = layer.per_frame, layer.dilation
    window = torch.randn(rows, layer.in_channels, n + layer.context)
    columns = [layer.weight[:, 0, k : k + 1].contiguous() for k in range(taps)]

    def call() -> Any:
        y = window[..., :n] * columns[0]
        for k in range(1, taps):
            y.addcmul_(window[..., k * d : k * d + n], columns[k])
        return y

    return call


def aten_ops(fn: Callable[[], Any]) -> int:
    """Aten operators one call of fn() dispatches."""
    from .host import count_aten_ops

    with count_aten_ops() as n:
        fn()
    return n[0]


def layer_call(layer: Any, rows: int) -> tuple[Callable[[], Any], tuple[int, ...]]:
    """A function making one steady call of `layer` on `rows` rows (fresh state each call), and its input shape."""
    import torch

    from ...codec.layers import Step

    dtype = torch.float32
    x = torch.randn(rows, layer.in_channels, layer.per_frame, dtype=dtype)
    frames = torch.full((rows,), 10, dtype=torch.long)
    never = torch.full((rows,), 1 << 40, dtype=torch.long)
    buffers = [torch.randn(rows, c, k, dtype=dtype) for c, k in layer.buffer_shapes()]

    def call() -> Any:
        return layer(x.clone(), Step(frames, never, list(buffers), need_mask=False))

    return call, tuple(x.shape)


def gemm_call(shape: tuple[int, int, int]) -> Callable[[], Any]:
    import torch

    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    return lambda: torch.mm(a, b)


def best_gemm_ms(shape: tuple[int, int, int], calls: int) -> tuple[str, float]:
    """The fastest this host runs the product (M, K) @ (K, N): `torch.mm`, or oneDNN on a packed weight, so a
    BLAS that falls off at a shape (MKL at few columns on an AMD EPYC) does not hide a layer's cliff."""
    import torch

    from ...codec.gemm import onednn_pack, packed_product

    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = ("mm", median_ms(lambda: torch.mm(a, b), calls))
    packed = onednn_pack(a)
    if packed is not None:
        bt = b.t().contiguous()
        best = min(best, ("packed", median_ms(lambda: packed_product(bt, packed), calls)), key=lambda x: x[1])
    return best


def replaced_call(layer: Any, rows: int) -> Callable[[], Any] | None:
    """The `F.conv*` call a layer ran before it took a GEMM formulation (docs/benchmarks.md), or None."""
    import torch
    import torch.nn.functional as F

    from ...codec.layers import _Conv, _ConvTranspose, _Noise, _Pointwise

    n = layer.per_frame
    if isinstance(layer, _ConvTranspose):
        s = layer.stride
        weight = layer.gemm.weight.t().reshape(layer.in_channels, layer.out_channels, 2 * s).contiguous()
        bias, window = layer.bias.view(-1), torch.randn(rows, layer.in_channels, n + 1)
        return lambda: F.conv_transpose1d(window, weight, bias, stride=s)[..., s : (n + 1) * s]
    if isinstance(layer, (_Pointwise, _Noise)):
        x, weight = torch.randn(rows, layer.in_channels, n), layer.gemm.weight.unsqueeze(-1)
        return lambda: F.conv1d(x, weight)
    if isinstance(layer, _Conv) and layer.taps is not None:
        window = torch.randn(rows, layer.in_channels, n + layer.context)
        return lambda: F.conv1d(window, layer.weight, layer.bias, dilation=layer.dilation)
    return None


def profile(
    snac: Any, rows: int = 1, calls: int = 20, reference: bool = True, packed: bool = True
) -> list[dict[str, Any]]:
    """Per layer at its steady shape: ms per call, its equivalent's ms, and their ratio (CLIFF_RATIO: a cliff).

    packed=False: the layers as a compiled step runs them, every product through `torch.mm` (before/after).
    """
    from ...codec.layers import _Conv, build_layers

    layers = build_layers(snac, packed=packed)
    tiny_op = median_ms(gemm_call((1, 1, 1)), max(calls, 50))
    out = []
    for name, layer in flat_layers(layers):
        call, shape = layer_call(layer, rows)
        ms = median_ms(call, calls)
        row: dict[str, Any] = {"layer": name, "kind": type(layer).__name__.lstrip("_"), "input": shape, "ms": ms}
        gemm = gemm_shape(layer, rows, layer.per_frame)
        if gemm is not None:
            way, row["equivalent_ms"] = best_gemm_ms(gemm, calls)
            row["equivalent"] = f"{way} " + "x".join(map(str, gemm))
        elif isinstance(layer, _Conv):
            row["equivalent"] = f"{layer.weight.shape[-1]} shifted MACs"
            row["equivalent_ms"] = median_ms(shifted_mac_call(layer, rows), calls)
        if "equivalent_ms" in row:
            row["aten_ops"] = aten_ops(call)
            row["ratio"] = ms / max(row["equivalent_ms"], row["aten_ops"] * tiny_op)
        replaced = replaced_call(layer, rows) if reference else None
        if replaced is not None:
            row["replaced_ms"] = median_ms(replaced, calls)
        out.append(row)
    return out


COLUMNS = {
    "layer": "layer",
    "kind": "kind",
    "input": "input",
    "ms": "ms",
    "equivalent": "equivalent",
    "equivalent_ms": "equiv. ms",
    "aten_ops": "ops",
    "ratio": "ratio",
    "replaced_ms": "F.conv* ms (before)",
}


def main(args: argparse.Namespace) -> int:
    """Run `bench layers` from parsed flags."""
    import torch

    from ...codec.snac import load_snac

    torch.set_num_threads(args.threads)
    snac = load_snac(args.snac, "cpu")
    result: dict[str, Any] = {"bench": "layers", "meta": run_metadata(), "threads": args.threads, "rows": {}}
    result["packed"] = not args.unpacked
    for rows in args.rows:
        print(f"{rows} row(s), one steady frame each ...", flush=True)
        table = profile(snac, rows, args.calls, packed=not args.unpacked)
        print_rows(table, COLUMNS)
        total = sum(r["ms"] for r in table)
        print(
            f"sum of layers: {total:.2f} ms per call = {total / 1e3 / rows / (2048 / 24000):.3f} s per audio s per row"
        )
        result["rows"][str(rows)] = {"layers": table, "sum_ms": total}
    write_json(result, args.json)
    return 0
