"""Time to first audio of a cloned voice against a stock one, with the hf prefix store on and off, side by side.

`python -m orpheus_tts_plugin.tools.bench.cloning [--model-dir DIR] [--requests 24] [--reference-s 10]`: on the
hf backend (the test model unless --model-dir holds `orpheus/` and `snac/`), p50 and p90 of the time from
`synthesize()` to its first chunk, at 1 and 8 concurrent streams, for three prompts: a stock voice, a cloned
voice (a `--reference-s` reference) with its reference turn's KV reused, and the same without reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...config import EngineConfig
from ...engine.core import OrpheusEngine
from ...spec import SAMPLE_RATE
from .common import host_line, print_rows

TEXT = "Hello there, how are you doing today?"


async def first_chunk_s(engine: OrpheusEngine, voice: str, seed: int) -> float:
    start = time.perf_counter()
    speech = engine.synthesize(TEXT, voice=voice, seed=seed, max_tokens=35)
    try:
        async for _ in speech:
            return time.perf_counter() - start
    finally:
        await speech.aclose()
    raise RuntimeError("no audio")


async def point(engine: OrpheusEngine, voice: str, streams: int, requests: int) -> list[float]:
    """`requests` times to first audio, `streams` requests at a time (each round starts together)."""
    out: list[float] = []
    while len(out) < requests:
        out += await asyncio.gather(*(first_chunk_s(engine, voice, len(out) + i) for i in range(streams)))
    return out


async def measure(model_dir: Path, requests: int, reference_s: float) -> list[dict[str, Any]]:
    cfg = EngineConfig(
        model=str(model_dir / "orpheus"),
        backend="hf",
        snac=str(model_dir / "snac"),
        device="cpu",
        max_batch_size=16,
        max_seq_len=2048,
    )
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(int(reference_s * SAMPLE_RATE))).astype(np.float32)
    engines = {}
    for reuse in (True, False):
        engine = OrpheusEngine(replace(cfg, backend_options=(("prefix_reuse", reuse),)))
        engine.add_voice("clone", audio=audio, transcript="A reference recording of the voice to clone, read aloud.")
        await engine.start()
        engines[reuse] = engine
    cases = {
        "stock": (engines[True], "tara"),
        "cloned, reuse": (engines[True], "clone"),
        "cloned, no reuse": (engines[False], "clone"),
    }
    rows = []
    try:
        for engine, voice in cases.values():  # warm up: the first forward of each shape, the prefix stored
            await point(engine, voice, 8, 8)
        for streams in (1, 8):
            for name, (engine, voice) in cases.items():
                times = np.array(await point(engine, voice, streams, requests)) * 1000
                rows.append(
                    {
                        "streams": streams,
                        "prompt": name,
                        "requests": len(times),
                        "p50_ms": float(np.percentile(times, 50)),
                        "p90_ms": float(np.percentile(times, 90)),
                    }
                )
        prompt_ids = engines[True].voices()[-1]["prompt_ids"]
    finally:
        for engine in engines.values():
            await engine.aclose()
    for row in rows:
        stock = next(r for r in rows if r["streams"] == row["streams"] and r["prompt"] == "stock")
        row["vs_stock"] = row["p50_ms"] / stock["p50_ms"]
        row["reference_prompt_ids"] = prompt_ids
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="holds orpheus/ and snac/ (default: the test model)"
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--reference-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from ..testmodel import make_test_model

            model_dir = Path(tmp)
            make_test_model(model_dir, snac="tiny")
        rows = asyncio.run(measure(model_dir, args.requests, args.reference_s))
    print(host_line())
    print(f"reference: {args.reference_s:g} s, {rows[0]['reference_prompt_ids']} prompt ids")
    columns = {"streams": "streams", "prompt": "prompt", "requests": "requests", "p50_ms": "p50 ms"}
    print_rows(rows, {**columns, "p90_ms": "p90 ms", "vs_stock": "p50 / stock"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
