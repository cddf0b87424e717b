"""`orpheus-tts bench decoder | overhead`: the streaming decoder vs the reference scheme, and host CPU per token."""

from __future__ import annotations

import argparse
import asyncio
import functools
from typing import Any

import numpy as np

from ...codec.decoder import DecodeState, StreamingDecoder
from ...codec.snac import load_snac, offline_decode
from ...spec import CODEBOOK_SIZE, SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from .common import cpu_timed, print_table, run_metadata, write_json
from .reference import reference_decode


def bench_decoder(
    snac_path: str, streams: int = 8, seconds: float = 4.0, device: str = "cpu", threads: int = 1, seed: int = 0
) -> dict[str, Any]:
    """Project decoder vs the reference 4-frame window, same weights, codes and concurrency.

    Each tick gives every stream one new frame; the project decodes all streams in one batched
    call and so does the reference (its 4-frame windows batched), timed alternately tick by
    tick so that both see the same machine load. CPU time is divided by the audio duration of
    all utterances (the reference also never emits the first frame and the last two).
    """
    import torch

    torch.set_num_threads(threads)
    snac = load_snac(snac_path, device)
    n_frames = max(6, round(seconds * SAMPLE_RATE / SAMPLES_PER_FRAME))
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, CODEBOOK_SIZE, size=(streams, n_frames, TOKENS_PER_FRAME))
    audio_seconds = streams * n_frames * SAMPLES_PER_FRAME / SAMPLE_RATE
    decoder = StreamingDecoder(snac)
    states = [decoder.new_state() for _ in range(streams)]
    outs: list[list[np.ndarray]] = [[] for _ in range(streams)]

    def project_tick(k: int) -> None:
        for s, st in enumerate(states):
            if k < n_frames:
                st.pending.append(frames[s, k : k + 1])
            else:
                st.final = True
        ready = [i for i, st in enumerate(states) if st.ready(decoder.first_chunk_frames)]
        for i, audio in zip(ready, decoder.decode([states[i] for i in ready])):
            outs[i].append(audio)

    with torch.inference_mode():
        reference_decode(snac, frames[:, :4])  # warm-up both (allocator, kernels)
        StreamingDecoder(snac).decode([_warm_state(frames[0])])
        cpu_ours = cpu_ref = wall_ours = wall_ref = 0.0
        for k in range(n_frames + 1):
            c, w, _ = cpu_timed(functools.partial(project_tick, k))
            cpu_ours, wall_ours = cpu_ours + c, wall_ours + w
            if 4 <= k <= n_frames:
                c, w, _ = cpu_timed(functools.partial(reference_decode, snac, frames[:, k - 4 : k]))
                cpu_ref, wall_ref = cpu_ref + c, wall_ref + w
    audio = [np.concatenate(o) for o in outs]
    exact = offline_decode(snac, frames[0])
    return {
        "bench": "decoder",
        "streams": streams,
        "frames_per_stream": n_frames,
        "audio_seconds": audio_seconds,
        "torch_threads": torch.get_num_threads(),
        "project_cpu_s_per_audio_s": cpu_ours / audio_seconds,
        "reference_cpu_s_per_audio_s": cpu_ref / audio_seconds,
        "cpu_ratio_reference_over_project": cpu_ref / cpu_ours,
        "project_wall_s": wall_ours,
        "reference_wall_s": wall_ref,
        "project_samples_per_stream": int(audio[0].size),
        "reference_samples_per_stream": int((n_frames - 3) * SAMPLES_PER_FRAME),
        "max_abs_diff_vs_offline_int16": int(np.abs(audio[0].astype(np.int32) - exact.astype(np.int32)).max()),
    }


def _warm_state(frames: np.ndarray) -> DecodeState:
    return DecodeState(pending=[frames[:4]], final=True)


def bench_overhead(streams: int = 256, frames: int = 48, rate: float = 0.0, loops: int = 1) -> dict[str, Any]:
    """Host CPU per token through the whole engine: synthetic backend, no-op decoder, `streams` at once.

    Counts every thread of the process (backend stepping, engine loop, decoder thread, the
    consumers' loops), from token arrival to PCM at the consumer, divided by the tokens.
    """
    from ...config import EngineConfig, SyntheticConfig
    from ...engine.core import OrpheusEngine

    config = EngineConfig(
        model=None,
        backend="synthetic",
        decoder="null",
        max_streams=max(256, streams),
        synthetic=SyntheticConfig(tokens_per_second=rate, min_frames=frames, frames_per_prompt_token=0.0),
    )
    engine = OrpheusEngine(config)

    async def consume(n: int) -> int:
        total = 0
        async for chunk in engine.synthesize("Overhead measurement utterance."):
            total += chunk.num_samples
        return total

    async def loop_main(n_streams: int) -> list[int]:
        await engine.start()
        return await asyncio.gather(*(consume(i) for i in range(n_streams)))

    async def warm() -> None:
        await engine.start()
        await asyncio.gather(*(consume(i) for i in range(8)))

    asyncio.run(warm())
    before = engine.stats()["tokens"]

    def run() -> list[int]:
        per_loop = [streams // loops + (1 if i < streams % loops else 0) for i in range(loops)]
        if loops == 1:
            return asyncio.run(loop_main(per_loop[0]))
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(loops) as pool:
            results = list(pool.map(lambda n: asyncio.run(loop_main(n)), per_loop))
        return [x for r in results for x in r]

    cpu, wall, samples = cpu_timed(run)
    stats = engine.stats()
    tokens = stats["tokens"] - before
    asyncio.run(engine.aclose())
    return {
        "bench": "overhead",
        "streams": streams,
        "event_loops": loops,
        "tokens": tokens,
        "samples_delivered": int(sum(samples)),
        "cpu_s": cpu,
        "wall_s": wall,
        "host_cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
        "decoder_calls": stats["decoder_calls"],
        "decoder_ticks": stats["decoder_ticks"],
    }


def main(args: argparse.Namespace) -> int:
    """Run `bench decoder` or `bench overhead` from parsed flags."""
    if args.what == "decoder":
        result = bench_decoder(
            args.snac, streams=args.streams, seconds=args.seconds, device=args.device, threads=args.threads
        )
    else:
        result = bench_overhead(streams=args.streams, frames=args.frames, rate=args.rate, loops=args.loops)
    print_table(result)
    write_json({**result, "meta": run_metadata()}, args.json)
    return 0
