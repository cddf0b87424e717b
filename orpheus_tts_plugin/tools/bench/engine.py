"""`orpheus-tts bench engine`: time to first byte, underruns and real-time capacity of the whole engine under load.

The fixed utterances of `bench_utterances` drive an in-process OrpheusEngine under constant traffic
(N streams, each starting its next utterance when the last ends) or variable traffic (Poisson
arrivals, a random utterance each, at the rate that offers N concurrent streams on average). Each
utterance gets a simulated player that starts at its first byte and plays at 24 kHz. A sweep over N
finds the real-time capacity; every decode scheme asked for runs the same workload in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import EngineConfig
from ...spec import SAMPLE_RATE, SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from .common import cpu_timed, run_metadata
from .figures import Utterance, capacity, report, summarize
from .utterances import UTTERANCES

if TYPE_CHECKING:
    from ...backends.protocol import TokenBackend
    from ...codec.decoder import FrameDecoder
    from ...engine.core import OrpheusEngine

# decode scheme → EngineConfig.decoder (the reference scheme is injected over the config's SNAC)
SCHEMES = {"project": "snac", "reference": "snac", "null": "null"}
TRAFFIC = ("constant", "variable")


@dataclass(frozen=True)
class BenchOptions:
    """One `bench engine` run: the engine to build and the sweep to drive it through."""

    backend: str = "synthetic"
    model: str | None = None
    snac: str = "hubertsiuzdak/snac_24khz"
    device: str = "auto"
    traffic: tuple[str, ...] = ("constant",)
    streams: tuple[int, ...] = (1, 2, 4, 8)  # concurrency levels; variable traffic offers them on average
    rates: tuple[float, ...] = ()  # variable traffic: arrivals per second instead of `streams`
    schemes: tuple[str, ...] = ("project",)
    duration_s: float = 15.0  # arrivals stop after this; utterances under way may finish within drain_s
    drain_s: float | None = None  # default: duration_s
    ramp_s: float = 1.0  # constant traffic: stream starts spread over this, as real calls are not in phase
    ttfb_sla_ms: float = 250.0
    synthetic_rate: float = 200.0  # synthetic backend: tokens/s per stream (real time ~83; TTFB floor 28/rate)
    budget_per_char: float = 6.0  # utterance length cap: natural speech, even from random weights that never stop
    budget_base: int = 0
    max_batch_size: int = 256
    decode_ahead_s: float | None = EngineConfig.decode_ahead_s  # None: every frame decoded as it comes
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not set(self.traffic) <= set(TRAFFIC) or not self.traffic:
            raise ValueError(f"traffic must be among {TRAFFIC}, got {self.traffic}")
        if not set(self.schemes) <= set(SCHEMES) or not self.schemes:
            raise ValueError(f"decode schemes must be among {tuple(SCHEMES)}, got {self.schemes}")
        if not self.streams or min(self.streams) < 1 or (self.rates and min(self.rates) <= 0):
            raise ValueError("streams must be >= 1 and rates > 0")
        if self.duration_s <= 0:
            raise ValueError("duration must be > 0")

    def engine_config(self, scheme: str) -> EngineConfig:
        """The engine that runs `scheme`; admission and batch limits sized so the sweep itself never queues."""
        from ...config import SyntheticConfig

        return EngineConfig(
            model=self.model,
            snac=self.snac,
            backend=self.backend,
            device=self.device,
            decoder=SCHEMES[scheme],
            max_streams=max(1024, 8 * max(self.streams)),
            max_batch_size=self.max_batch_size,
            decode_ahead_s=self.decode_ahead_s,
            token_budget_per_char=self.budget_per_char,
            token_budget_base=self.budget_base,
            # Long enough that the token budget, not the prompt, sets each length: the same lengths as hf.
            synthetic=SyntheticConfig(tokens_per_second=self.synthetic_rate, frames_per_prompt_token=64.0),
        )

    def levels(self, traffic: str) -> list[tuple[float, float | None]]:
        """(offered concurrency, arrivals per second or None) of each sweep point, ascending."""
        if traffic == "constant":
            return [(float(n), None) for n in sorted(self.streams)]
        mean_s = float(np.mean([expected_audio_s(t, self) for t in UTTERANCES]))
        if self.rates:
            return [(r * mean_s, r) for r in sorted(self.rates)]
        return [(float(n), n / mean_s) for n in sorted(self.streams)]


def expected_audio_s(text: str, opts: BenchOptions) -> float:
    """Audio seconds of `text` if every piece runs to its token budget (the length random weights produce)."""
    from ...config import SamplingParams
    from ...speech.prompt import token_budget
    from ...speech.text import split_sentences

    cap = SamplingParams().max_tokens
    tokens = sum(token_budget(p, opts.budget_per_char, opts.budget_base, cap)[0] for p in split_sentences(text))
    return tokens // TOKENS_PER_FRAME * SAMPLES_PER_FRAME / SAMPLE_RATE


# ------------------------------------------------------------------------------------------ traffic


async def _speak(engine: OrpheusEngine, text: str, rec: Utterance) -> None:
    from ...errors import EngineOverloadedError

    try:
        async for chunk in engine.synthesize(text):
            if chunk.num_samples:
                rec.chunks.append((time.perf_counter(), chunk.num_samples))
        rec.complete = True
    except EngineOverloadedError:
        rec.rejected = True
    finally:
        rec.ended = time.perf_counter()


async def _finish(tasks: list[asyncio.Task[Any]], deadline: float) -> None:
    """Let utterances under way finish until `deadline`, then cancel the rest (they count as incomplete)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def constant_traffic(
    engine: OrpheusEngine, streams: int, duration_s: float, drain_s: float, ramp_s: float
) -> list[Utterance]:
    """`streams` callers, each speaking the utterances in turn from its own offset until `duration_s`."""
    records: list[Utterance] = []
    t0 = time.perf_counter()

    async def caller(i: int) -> None:
        await asyncio.sleep(ramp_s * i / streams)
        k = i * len(UTTERANCES) // streams
        while time.perf_counter() - t0 < duration_s:
            rec = Utterance(k % len(UTTERANCES), time.perf_counter())
            records.append(rec)
            await _speak(engine, UTTERANCES[rec.text], rec)
            k += 1

    await _finish([asyncio.create_task(caller(i)) for i in range(streams)], t0 + duration_s + drain_s)
    return records


async def variable_traffic(
    engine: OrpheusEngine, rate: float, duration_s: float, drain_s: float, seed: int
) -> list[Utterance]:
    """Poisson arrivals at `rate` per second for `duration_s`, each a random utterance (same seed, same calls)."""
    rng = np.random.default_rng(seed)
    records: list[Utterance] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    at = rng.exponential(1.0 / rate)
    while at < duration_s:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        rec = Utterance(int(rng.integers(len(UTTERANCES))), time.perf_counter())
        records.append(rec)
        tasks.append(asyncio.create_task(_speak(engine, UTTERANCES[rec.text], rec)))
        at += rng.exponential(1.0 / rate)
    await _finish(tasks, t0 + duration_s + drain_s)
    return records


# ------------------------------------------------------------------------------------------ sweep


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    """A tqdm bar on stderr (or nothing, if disabled or tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield None
        return
    with tqdm(total=total, unit="point", dynamic_ncols=True) as bar:
        yield bar


async def _settle(engine: OrpheusEngine, timeout_s: float = 10.0) -> None:
    """Wait until every stream of the last point has left the engine (cancelled ones release a step later)."""
    end = time.perf_counter() + timeout_s
    while engine.stats()["active_streams"] and time.perf_counter() < end:
        await asyncio.sleep(0.02)


def run_point(
    engine: OrpheusEngine,
    opts: BenchOptions,
    traffic: str,
    level: float,
    rate: float | None,
    bar: Any = None,
    scheme: str = "project",
) -> dict[str, Any]:
    """Drive `engine` with one traffic pattern at one level; the point's figures."""
    drain = opts.duration_s if opts.drain_s is None else opts.drain_s
    before = engine.stats()

    async def drive() -> list[Utterance]:
        await engine.start()
        if traffic == "constant":
            load = constant_traffic(engine, int(level), opts.duration_s, drain, opts.ramp_s)
        else:
            load = variable_traffic(engine, rate, opts.duration_s, drain, opts.seed + int(level * 1000))
        ticker = asyncio.create_task(_tick(bar, engine)) if bar is not None else None
        try:
            return await load
        finally:
            if ticker is not None:
                ticker.cancel()
            await _settle(engine)

    cpu, wall, records = cpu_timed(lambda: asyncio.run(drive()))
    after = engine.stats()
    tokens = after.get("tokens", 0) - before.get("tokens", 0)
    decoded = after.get("decoded_frames", 0) - before.get("decoded_frames", 0)
    point = {"traffic": traffic, "scheme": scheme, "concurrency": level, "rate_per_s": rate}
    point.update(summarize(records, wall, cpu, tokens, opts.ttfb_sla_ms))
    point["decoder_calls"] = after.get("decoder_calls", 0) - before.get("decoder_calls", 0)
    audio_frames = point["audio_s"] * SAMPLE_RATE / SAMPLES_PER_FRAME
    point["decoded_frames_per_audio_frame"] = decoded / audio_frames if audio_frames else None
    return point


async def _tick(bar: Any, engine: OrpheusEngine) -> None:
    while True:
        stats = engine.stats()
        bar.set_postfix(live=stats["active_streams"], done=stats.get("streams_completed", 0), refresh=True)
        await asyncio.sleep(0.5)


def reference_decoder(config: EngineConfig) -> FrameDecoder:
    """The reference 4-frame-window scheme on the config's SNAC, for `--decode-scheme reference`."""
    from ...codec.snac import load_snac
    from ...engine.device import resolve_device
    from .reference import ReferenceDecoder

    return ReferenceDecoder(load_snac(config.snac, resolve_device(config.device), noise_seed=config.noise_seed))


async def _warm(engine: OrpheusEngine) -> None:
    """Start the engine and speak one utterance: loading and first-call costs stay out of the figures."""
    await engine.start()
    await _speak(engine, UTTERANCES[0], Utterance(0, time.perf_counter()))


def run(opts: BenchOptions, make_backend: Callable[[], TokenBackend] | None = None) -> dict[str, Any]:
    """The whole sweep, every scheme on its own engine in turn; `make_backend` overrides the configured one."""
    from ...engine.core import OrpheusEngine

    meta = run_metadata()
    points: list[dict[str, Any]] = []
    total = len(opts.schemes) * sum(len(opts.levels(t)) for t in opts.traffic)
    with _progress(total, opts.progress) as bar:
        for scheme in opts.schemes:
            config = opts.engine_config(scheme)
            engine = OrpheusEngine(
                config,
                backend=make_backend() if make_backend else None,
                decoder=reference_decoder(config) if scheme == "reference" else None,
            )
            try:
                asyncio.run(_warm(engine))
                for traffic in opts.traffic:
                    for level, rate in opts.levels(traffic):
                        if bar is not None:
                            bar.set_description(f"{traffic} {scheme} N={level:g}")
                        points.append(run_point(engine, opts, traffic, level, rate, bar, scheme))
                        if bar is not None:
                            bar.update()
            finally:
                asyncio.run(engine.aclose())
    return {"bench": "engine", "meta": meta, "options": asdict(opts), "points": points, "capacity": capacity(points)}


# ------------------------------------------------------------------------------------------ command line


def _list(kind: type) -> Callable[[str], tuple[Any, ...]]:
    return lambda text: tuple(kind(v) for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `bench engine` flags."""
    d = BenchOptions()
    p.add_argument("--backend", default=d.backend, help="hf | synthetic | trtllm | vllm | remote")
    p.add_argument("--model", default=d.model, help="model dir or hub id (synthetic: optional, for its tokenizer)")
    p.add_argument("--snac", default=d.snac, help="hub id or local directory")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--traffic", type=_list(str), default=d.traffic, help="constant, variable or constant,variable")
    p.add_argument("--streams", type=_list(int), default=d.streams, help="concurrency sweep, e.g. 1,2,4,8")
    p.add_argument("--rates", type=_list(float), default=d.rates, help="variable: arrivals/s instead of --streams")
    p.add_argument(
        "--decode-scheme",
        dest="schemes",
        type=_list(str),
        default=d.schemes,
        help="project, reference (4-frame windows, one stream at a time; also runs project as its baseline), "
        "null (no SNAC: the engine alone)",
    )
    p.add_argument("--duration", dest="duration_s", type=float, default=d.duration_s, help="seconds per point")
    p.add_argument("--drain", dest="drain_s", type=float, default=None, help="seconds to finish (default duration)")
    p.add_argument("--ramp", dest="ramp_s", type=float, default=d.ramp_s, help="constant: stream starts spread (s)")
    p.add_argument("--ttfb-sla-ms", type=float, default=d.ttfb_sla_ms, help="p95 TTFB limit for capacity")
    p.add_argument("--token-rate", dest="synthetic_rate", type=float, default=d.synthetic_rate, help="synthetic tok/s")
    p.add_argument("--budget-per-char", type=float, default=d.budget_per_char, help="tokens per character cap")
    p.add_argument(
        "--budget-base", type=int, default=d.budget_base, help="an utterance's token budget besides --budget-per-char"
    )
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="hf: rows per step")
    p.add_argument(
        "--decode-ahead",
        dest="decode_ahead_s",
        type=lambda v: None if v == "off" else float(v),
        default=d.decode_ahead_s,
        help="seconds ahead of real time beyond which a stream is decoded 4 frames a call; off: never",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the traffic (texts, arrivals)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", default=None, help="write the result here and PNG plots beside it")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from parsed flags; asking for the reference scheme brings the project's as its baseline."""
    schemes = tuple(args.schemes)
    if "reference" in schemes and "project" not in schemes:
        schemes = ("project", *schemes)
    names = set(BenchOptions.__dataclass_fields__) - {"schemes"}
    return BenchOptions(schemes=schemes, **{k: v for k, v in vars(args).items() if k in names})


def main(args: argparse.Namespace) -> int:
    """Run `bench engine` from parsed flags."""
    result = run(options_from_args(args))
    report(result, args.json)
    return 0
