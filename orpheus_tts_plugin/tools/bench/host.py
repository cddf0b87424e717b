"""`orpheus-tts bench host`: aten operators and host time per steady decoder tick, by number of streams.

A steady tick gives every stream one new frame and decodes them all. On a GPU every aten operator is
host time (and every non-view one a kernel launch), so their count per tick must not grow with the
streams: the decoder gathers pooled per-slot state instead of slicing per-row buffers.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .common import median_ms, print_rows, run_metadata, write_json


@contextlib.contextmanager
def count_aten_ops() -> Iterator[list[int]]:
    """Count the aten operators dispatched inside the block (views included): `with count_aten_ops() as n:`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counter = [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            counter[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        yield counter


def steady_ticks(snac: Any, streams: int, compile: bool, seed: int = 0) -> tuple[Any, Any]:
    """A decoder with `streams` utterances past their first chunk, and a function running one steady tick."""
    from ...codec.decoder import StreamingDecoder

    decoder = StreamingDecoder(snac, max_streams=streams, compile=compile)
    if compile:
        decoder.warm()
    states = [decoder.new_state() for _ in range(streams)]
    frames = np.random.default_rng(seed).integers(0, 4096, size=(streams, 64, 7))
    k = 0

    def tick() -> list[Any]:
        nonlocal k
        for st, f in zip(states, frames):
            st.pending.append(f[k % 64 : k % 64 + 1])
        k += 1
        return decoder.decode(states)

    for _ in range(decoder.first_chunk_frames):
        tick()
    return decoder, tick


def measure(snac: Any, streams: int, compile: bool, ticks: int) -> dict[str, Any]:
    """Aten ops (one counted tick, eager only) and median wall ms per steady tick at `streams` streams.

    Counting needs a dispatch mode, under which compiled code runs eagerly: compiled ticks report no count.
    """
    _, tick = steady_ticks(snac, streams, compile)
    tick()
    ops = [None]
    if not compile:
        with count_aten_ops() as ops:
            tick()
    return {"aten_ops_per_tick": ops[0], "host_ms_per_tick": median_ms(tick, ticks, warmup=0)}


def main(args: argparse.Namespace) -> int:
    """Run `bench host` from parsed flags."""
    import torch

    from ...codec.snac import load_snac

    torch.set_num_threads(args.threads)
    snac = load_snac(args.snac, args.device)
    modes = ("eager", "compiled") if args.compile else ("eager",)  # eager first: its figures come in seconds
    result: dict[str, Any] = {"bench": "host", "meta": run_metadata(), "device": args.device, "decoder": {}}
    rows = []
    for mode in modes:
        points = {}
        for n in args.streams:
            print(f"{mode}, {n} streams ...", end=" ", flush=True)
            points[str(n)] = measure(snac, n, mode == "compiled", args.ticks)
            rows.append({"mode": mode, "streams": n, **points[str(n)]})
            print(f"{points[str(n)]['host_ms_per_tick']:.1f} ms per tick", flush=True)
        result["decoder" if mode == "eager" else "decoder_compiled"] = {"streams": points}
    one, top = str(min(args.streams)), str(max(args.streams))
    eager = result["decoder"]["streams"]
    result["decoder"]["aten_ops_ratio_max_over_min_streams"] = eager[top]["aten_ops_per_tick"] / max(
        1, eager[one]["aten_ops_per_tick"]
    )
    print_rows(rows, {"mode": "mode", "streams": "streams", "aten_ops_per_tick": "aten ops", "host_ms_per_tick": "ms"})
    print(f"aten ops per tick, {top} streams / {one}: {result['decoder']['aten_ops_ratio_max_over_min_streams']:.3f}")
    write_json(result, args.json)
    return 0
