"""The `orpheus-tts` command: say, decode, bench, make-test-model."""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave
from pathlib import Path

import numpy as np

from .spec import SAMPLE_RATE, SAMPLES_PER_FRAME


def write_wav(path: str | Path, pcm: bytes | np.ndarray) -> None:
    """Write int16 mono 24 kHz PCM as a WAV file."""
    data = pcm.astype("<i2").tobytes() if isinstance(pcm, np.ndarray) else pcm
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(data)


def read_wav(path: str | Path) -> np.ndarray:
    """Read an int16 mono WAV (as written by write_wav)."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def _cmd_say(args: argparse.Namespace) -> int:
    from .engine import EngineConfig, OrpheusEngine

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


def _cmd_decode(args: argparse.Namespace) -> int:
    from .decoder import StreamingDecoder, load_snac
    from .replay import replay_offline, replay_streaming, split_utterances
    from .spec import spec_for

    spec = spec_for(args.model_family)
    ids = np.load(args.tokens)
    snac = load_snac(args.snac, args.device if args.device != "auto" else "cpu", noise_seed=args.noise_seed)
    if args.offline:
        audio = replay_offline(snac, ids, spec)
    else:
        audio = replay_streaming(StreamingDecoder(snac, args.first_chunk_frames), ids, spec)
    write_wav(args.out, audio)
    n_utt = len(split_utterances(ids, spec))
    mode = "offline" if args.offline else "streaming"
    print(
        f"wrote {args.out}: {audio.size} samples ({audio.size / SAMPLES_PER_FRAME:g} frames) from "
        f"{n_utt} utterance(s), {mode} decode"
    )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    a, b = read_wav(args.a), read_wav(args.b)
    if a.size != b.size:
        print(f"length differs: {a.size} vs {b.size} samples")
        return 1
    diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if a.size else 0
    ok = diff <= args.tolerance
    print(
        f"{a.size} samples each; max abs difference {diff} int16 steps (tolerance {args.tolerance}): "
        f"{'OK' if ok else 'DIFFERENT'}"
    )
    return 0 if ok else 1


def _cmd_make_test_model(args: argparse.Namespace) -> int:
    from .testmodel import make_test_model

    make_test_model(args.dir, snac=args.snac, seed=args.seed)
    print(f"wrote {Path(args.dir) / 'orpheus'} and {Path(args.dir) / 'snac'}")
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    from .engine import EngineConfig
    from .weights import download_files, hub_repos

    config = EngineConfig(model=args.model, snac=args.snac)
    download_files(config)
    print(f"fetched {', '.join(hub_repos(config))} into the Hugging Face cache")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.what == "decoder":
        result = bench.bench_decoder(
            args.snac, streams=args.streams, seconds=args.seconds, device=args.device, threads=args.threads
        )
    else:
        result = bench.bench_overhead(streams=args.streams, frames=args.frames, rate=args.rate, loops=args.loops)
    bench.print_table(result)
    bench.write_json({**result, "meta": bench.run_metadata()}, args.json)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    """`bench decoder | overhead | engine`, each with its own flags."""
    from . import bench_engine

    bench = sub.add_parser("bench", help="report decoder and engine figures")
    what = bench.add_subparsers(dest="what", required=True)
    dec = what.add_parser("decoder", help="SNAC decode CPU per audio second: project vs reference scheme")
    dec.add_argument("--snac", default="hubertsiuzdak/snac_24khz", help="SNAC checkpoint")
    dec.add_argument("--streams", type=int, default=8, help="concurrent streams")
    dec.add_argument("--seconds", type=float, default=4.0, help="audio seconds per stream")
    dec.add_argument("--device", default="cpu")
    dec.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    over = what.add_parser("overhead", help="host CPU per token: synthetic backend, no-op decoder")
    over.add_argument("--streams", type=int, default=256, help="concurrent streams")
    over.add_argument("--frames", type=int, default=48, help="frames per utterance")
    over.add_argument("--rate", type=float, default=0.0, help="tokens/s per stream (0 = flat out)")
    over.add_argument("--loops", type=int, default=1, help="consumer event loops (threads)")
    for p in (dec, over):
        p.add_argument("--json", default=None)
        p.set_defaults(func=_cmd_bench)
    eng = what.add_parser("engine", help="TTFB, underruns and real-time capacity of the engine under traffic")
    bench_engine.add_arguments(eng)
    eng.set_defaults(func=bench_engine.main)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orpheus-tts", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    say = sub.add_parser("say", help="speak text to a WAV file")
    say.add_argument("text")
    say.add_argument("--model", default="canopylabs/orpheus-3b-0.1-ft")
    say.add_argument("--snac", default="hubertsiuzdak/snac_24khz")
    say.add_argument("--backend", default="hf")
    say.add_argument("--device", default="auto")
    say.add_argument("--voice", default=None)
    say.add_argument("--out", required=True)
    say.add_argument("--save-tokens", default=None, help="save generated ids (.npy) for `decode`")
    say.add_argument("--seed", type=int, default=None)
    say.set_defaults(func=_cmd_say)

    dec = sub.add_parser("decode", help="replay saved token ids through the decoder")
    dec.add_argument("tokens")
    dec.add_argument("--snac", default="hubertsiuzdak/snac_24khz")
    dec.add_argument("--out", required=True)
    dec.add_argument("--offline", action="store_true", help="decode each utterance whole instead of streaming")
    dec.add_argument("--device", default="cpu")
    dec.add_argument("--model-family", default="orpheus-en")
    dec.add_argument("--first-chunk-frames", type=int, default=4)
    dec.add_argument("--noise-seed", type=int, default=0)
    dec.set_defaults(func=_cmd_decode)

    cmp_ = sub.add_parser("compare", help="max abs difference of two WAVs (exit 1 above the tolerance)")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--tolerance", type=int, default=33)
    cmp_.set_defaults(func=_cmd_compare)

    dl = sub.add_parser("download", help="fetch Orpheus and SNAC weights into the Hugging Face cache")
    dl.add_argument("--model", default="canopylabs/orpheus-3b-0.1-ft")
    dl.add_argument("--snac", default="hubertsiuzdak/snac_24khz")
    dl.set_defaults(func=_cmd_download)

    mk = sub.add_parser("make-test-model", help="write random-weight Orpheus-shaped and SNAC checkpoints")
    mk.add_argument("dir")
    mk.add_argument("--snac", choices=("full", "tiny"), default="full")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_cmd_make_test_model)

    from . import quantize as _quantize

    q = sub.add_parser("quantize", help="FP8-quantise an Orpheus checkpoint with NVIDIA ModelOpt (for trtllm/vllm)")
    _quantize.add_arguments(q)
    q.set_defaults(func=_quantize.quantize_main)

    _add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
