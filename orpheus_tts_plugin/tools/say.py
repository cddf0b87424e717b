"""`orpheus-tts say`: speak text through a whole engine to a WAV file (and optionally save the token ids)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from ..config import EngineConfig
from ..engine.core import OrpheusEngine
from ..interrupt import Interrupted
from ..preflight import check_before_load
from ..spec import SAMPLE_RATE
from .wav import write_wav


def say_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts say` from parsed arguments; Ctrl-C once speaking writes what was spoken so far."""
    config = EngineConfig(model=args.model, snac=args.snac, backend=args.backend, device=args.device)
    check_before_load(config, args.voice)
    engine = OrpheusEngine(config)
    pcm = bytearray()
    token_log: list[int] = []
    try:
        asyncio.run(_speak(engine, args, pcm, token_log))
    except KeyboardInterrupt:
        if not pcm:
            raise
        _save(args, pcm, token_log)
        raise Interrupted(f"wrote the {len(pcm) / 2 / SAMPLE_RATE:.2f} s spoken so far to {args.out}") from None
    _save(args, pcm, token_log)
    stats = engine.stats()
    finish = {k[7:]: v for k, v in stats.items() if k.startswith("finish_")}
    print(
        f"wrote {args.out}: {len(pcm) // 2} samples ({len(pcm) / 2 / SAMPLE_RATE:.2f} s) at {SAMPLE_RATE} Hz, "
        f"{stats.get('tokens', 0)} tokens, finish {finish}"
        + (f"; tokens saved to {args.save_tokens}" if args.save_tokens else "")
    )
    return 0


async def _speak(engine: OrpheusEngine, args: argparse.Namespace, pcm: bytearray, token_log: list[int]) -> None:
    """Load `engine`, speak `args.text` into `pcm` and close the engine (also when cancelled by Ctrl-C)."""
    _progress(f"loading {args.model} ({args.backend})")
    began = time.monotonic()
    await engine.start()
    try:
        _progress(f"speaking (loaded in {time.monotonic() - began:.1f} s)")
        async for chunk in engine.synthesize(args.text, voice=args.voice, seed=args.seed, token_log=token_log):
            pcm += chunk.pcm
    finally:
        await engine.aclose()


def _progress(line: str) -> None:
    print(f"orpheus-tts say: {line}", file=sys.stderr, flush=True)


def _save(args: argparse.Namespace, pcm: bytearray, token_log: list[int]) -> None:
    write_wav(args.out, bytes(pcm))
    if args.save_tokens:
        np.save(args.save_tokens, np.asarray(token_log, dtype=np.int64))
