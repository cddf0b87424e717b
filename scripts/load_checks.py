#!/usr/bin/env python
"""The engine under load, as figures (the tests assert the same behaviours without timing).

    python scripts/load_checks.py --model DIR/orpheus --snac DIR/snac-full [--json out/load-checks.json]

`--model` only provides the tokenizer (the backend is the unpaced synthetic one: generation runs far ahead
of decoding, as on a GPU). Prints: the order check's max difference (a 6-sentence text vs its sentences
spoken alone), peak RSS growth while speaking a 20,000-character text, the time from an injected decoder
fault to the error at the consumer, and RSS after 200 and 1,000 interrupted streams.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from orpheus_tts_plugin import EngineConfig, EngineError, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.codec.decoder import StreamingDecoder
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.tools.bench.common import print_table, run_metadata, write_json

SIX = (
    "The first sentence is short. Here comes the second one. A third follows it. "
    "Then a fourth arrives at last. The fifth is nearly done. And this is the sixth."
)
WORDS = "the quick brown fox jumps over a lazy dog while seven friends watch and cheer loudly".split()


def long_text(chars: int, seed: int = 0) -> str:
    """About `chars` characters of sentences of 8 to 20 words."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while sum(len(s) + 1 for s in out) < chars:
        words = rng.choice(WORDS, size=int(rng.integers(8, 21)))
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def pcm(engine: OrpheusEngine, text: str, **options: Any) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(text, **options)]), "<i2")


class Poisoned(StreamingDecoder):
    """Corrupts the first frame of the stream seeded 999 (codes out of the codebook) and notes when."""

    faulted_at: float | None = None

    def decode(self, states):  # type: ignore[no-untyped-def]
        for st in states:
            if st.frames_in == 0 and st.pending and np.array_equal(st.pending[0][0], self.poison):
                st.pending[0] = np.full_like(st.pending[0], 4096)
                self.faulted_at = time.perf_counter()
        return super().decode(states)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = EngineConfig(
        model=args.model, backend="synthetic", snac=args.snac, device="cpu", synthetic=SyntheticConfig()
    )
    out: dict[str, Any] = {}
    engine = OrpheusEngine(base)
    await engine.start()
    try:
        await pcm(engine, "Warm up.", seed=0)
        # order: sentence i of a long text equals that sentence alone with seed + i
        short = OrpheusEngine(replace(base, sentence_max_chars=40))
        await short.start()
        whole = await pcm(short, SIX, seed=7)
        alone = np.concatenate([await pcm(short, p, seed=7 + i) for i, p in enumerate(short.sentences(SIX))])
        await short.aclose()
        out["order_max_diff_int16"] = int(np.abs(whole.astype(int) - alone.astype(int)).max())
        # bounded work: a 20,000-character text, generation unpaced
        text = long_text(args.chars)
        before, t = rss_mb(), time.perf_counter()
        samples = (await pcm(engine, text, seed=1)).size
        out.update(
            long_text_chars=len(text),
            long_text_sentences=len(engine.sentences(text)),
            long_text_audio_s=samples / 24000,
            long_text_wall_s=time.perf_counter() - t,
            long_text_rss_before_mb=before,
            long_text_peak_rss_growth_mb=peak_rss_mb() - before,
            decoder_calls_by_chunk=engine.stats()["decoder_calls_by_chunk"],
        )
        # memory: 1,000 interrupted streams
        for i in range(1, args.interrupted + 1):
            stream = engine.synthesize(SIX, seed=i)
            await stream.__anext__()
            await stream.aclose()
            if i in (200, args.interrupted):
                while engine.stats()["active_streams"]:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(1.2)
                out[f"rss_after_{i}_interrupted_mb"] = rss_mb()
    finally:
        await engine.aclose()
    # isolation: an injected decoder fault → the error at its consumer
    decoder = Poisoned(load_snac(args.snac))
    decoder.poison = np.random.default_rng(999).integers(0, 4096, size=7)
    engine = OrpheusEngine(base, decoder=decoder)
    await engine.start()
    try:
        try:
            await pcm(engine, "Good morning to you.", seed=999)
        except EngineError:
            out["decoder_fault_to_consumer_error_ms"] = (time.perf_counter() - decoder.faulted_at) * 1e3
        out["other_streams_after_fault_ok"] = bool((await pcm(engine, "Still here.", seed=3)).size)
    finally:
        await engine.aclose()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model dir for its tokenizer (make-test-model DIR/orpheus)")
    p.add_argument("--snac", required=True, help="SNAC checkpoint (the full-size one for the memory figures)")
    p.add_argument("--chars", type=int, default=20_000)
    p.add_argument("--interrupted", type=int, default=1000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = asyncio.run(run(args))
    print_table(result)
    write_json({**result, "meta": run_metadata()}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
