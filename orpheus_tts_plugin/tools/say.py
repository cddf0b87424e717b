"""`orpheus-tts say`: speak text through a whole engine to a WAV file (and optionally save the token ids)."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from ..config import EngineConfig
from ..engine import OrpheusEngine
from ..spec import SAMPLE_RATE
from .wav import write_wav


def say_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts say` from parsed arguments."""
    config = EngineConfig(model=args.model, snac=args.snac, backend=args.backend, device=args.device)
    engine = OrpheusEngine(config)
    token_log: list[int] = []

    async def run() -> bytes:
        await engine.start()
        try:
            pcm = bytearray()
            async for chunk in engine.synthesize(args.text, voice=args.voice, seed=args.seed, token_log=token_log):
                pcm += chunk.pcm
            return bytes(pcm)
        finally:
            await engine.aclose()

    pcm = asyncio.run(run())
    write_wav(args.out, pcm)
    if args.save_tokens:
        np.save(args.save_tokens, np.asarray(token_log, dtype=np.int64))
    stats = engine.stats()
    finish = {k[7:]: v for k, v in stats.items() if k.startswith("finish_")}
    print(
        f"wrote {args.out}: {len(pcm) // 2} samples ({len(pcm) / 2 / SAMPLE_RATE:.2f} s) at {SAMPLE_RATE} Hz, "
        f"{stats.get('tokens', 0)} tokens, finish {finish}"
        + (f"; tokens saved to {args.save_tokens}" if args.save_tokens else "")
    )
    return 0
