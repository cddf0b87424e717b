#!/usr/bin/env python
"""One-GPU benchmark of orpheus_tts_plugin (sized for one NVIDIA H200, under 10 minutes), with a CPU smoke mode.

Measures, with random weights of the real shapes (Orpheus-3B Llama, SNAC 24 kHz), so timing and not speech:
  (a) decoder: audio seconds decoded per second, project streaming scheme vs the reference 4-frame window,
      batch 1 to 256, eager and under CUDA graphs;
  (b) hf backend: tokens/s and time to first token / to the 28 tokens of the first audio, concurrency 1 to 256;
  (c) `bench engine`: TTFB, underruns and real-time capacity of the whole engine (hf backend + project decoder).
Each part has a time budget and records what it skipped; a failing part is recorded and the others still run.

The GPU machine has no network and only PyTorch, Triton and transformers. Fetch snac and einops here, where
there is network, into the repository copy that travels to the GPU machine:
    pip download snac==1.2.1 einops --no-deps -d wheels/
There, put them and this checkout on the import path (pure-Python wheels import from the zip), then run:
    PYTHONPATH=".:$(ls wheels/*.whl | paste -sd:)" python scripts/gpu_bench.py --out docs/gpu-h200.json
CPU smoke test (tiny sizes, seconds; what CI runs):
    python scripts/gpu_bench.py --smoke --out /tmp/gpu-smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orpheus_tts_plugin.spec import ENGLISH, SAMPLE_RATE, SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.bench.common import print_rows, run_metadata, write_json
from orpheus_tts_plugin.tools.testmodel import ROPE_SCALING, ROPE_THETA

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE
REALTIME_TOKENS_PER_S = 7 / FRAME_S  # 82.0: tokens a stream needs per second of audio
ORPHEUS_3B = dict(  # canopylabs/orpheus-3b-0.1-ft (Llama 3.2 3B)
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip
TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Sizes and time budgets of one run."""

    snac: str = "full"
    llama: tuple[tuple[str, Any], ...] = tuple(ORPHEUS_3B.items())
    decoder_batches: tuple[int, ...] = (1, 4, 16, 64, 128, 256)
    decoder_modes: tuple[str, ...] = ("eager", "compiled", "graphs")  # graphs on CUDA only
    decoder_ticks: int = 40
    backend_concurrency: tuple[int, ...] = (1, 4, 16, 64, 128, 256)
    backend_tokens: int = 287  # 41 frames, 3.5 s of audio per request
    eager_concurrency: tuple[int, ...] = (1, 64)  # the eager hf step, launch-bound on CUDA: a few points
    engine_streams: tuple[int, ...] = (1, 4, 16, 32, 64, 128)
    engine_duration_s: float = 12.0
    engine_budget_per_char: float = 6.0
    max_seq_len: int = 2048
    budgets_s: tuple[tuple[str, float], ...] = (("decoder", 120.0), ("backend", 150.0), ("engine", 210.0))
    min_left_s: float = 15.0  # do not start a point with less than this left in its part


SMOKE = Plan(
    snac="tiny",
    llama=tuple(TINY_LLAMA.items()),
    decoder_batches=(1, 2),
    decoder_modes=("eager",),  # compiling on CPU takes minutes; test_decoder covers the compiled step
    decoder_ticks=3,
    backend_concurrency=(1, 2),
    backend_tokens=35,
    eager_concurrency=(1, 2),
    engine_streams=(1, 2),
    engine_duration_s=1.0,
    engine_budget_per_char=1.0,
    max_seq_len=1024,
    budgets_s=(("decoder", 150.0), ("backend", 60.0), ("engine", 60.0)),
    min_left_s=0.0,
)


class Clock:
    """Deadlines of the parts; `left()` is what remains of the current one."""

    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.end = self.start + budget_s
        self.part_end = self.end

    def begin(self, budget_s: float) -> None:
        self.part_end = min(self.end, time.monotonic() + budget_s)

    def left(self) -> float:
        return self.part_end - time.monotonic()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_tick_s(tick: Callable[[], Any], ticks: int, budget_s: float) -> float:
    """Median wall seconds of tick() after two warm-up calls, over `ticks` calls or `budget_s`."""
    tick(), tick()
    _sync()
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < ticks and (len(times) < 3 or time.perf_counter() < end):
        t = time.perf_counter()
        tick()
        _sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


# ------------------------------------------------------------------------------------ (a) decoder


def _decoder_modes(device: str, plan: Plan) -> dict[str, dict[str, bool]]:
    """The plan's decoder variants: eager, torch.compile, and (on CUDA) compiled steps replayed as CUDA graphs."""
    modes = {"eager": {"compile": False, "cuda_graphs": False}, "compiled": {"compile": True, "cuda_graphs": False}}
    if device.startswith("cuda"):
        modes["graphs"] = {"compile": True, "cuda_graphs": True}
    return {mode: flags for mode, flags in modes.items() if mode in plan.decoder_modes}


def _decoder_batch(
    snac: Any, decoders: dict[str, Any], batch: int, plan: Plan, clock: Clock, device: str
) -> dict[str, Any]:
    """One batch size: steady 1-frame ticks of the project decoder in each mode, and the reference scheme.

    One decoder per mode serves every batch size (its buckets are shared), so each shape compiles or is
    captured once; the first steady tick's time, compilation included, is reported apart.
    """
    from orpheus_tts_plugin.codec.decoder import StreamingDecoder
    from orpheus_tts_plugin.tools.bench.reference import reference_decode

    frames = np.random.default_rng(batch).integers(0, 4096, size=(batch, 64, 7))
    tick_budget = max(1.0, min(10.0, clock.left() / 10))
    audio_s = batch * FRAME_S
    row: dict[str, Any] = {"batch": batch}
    first: list[np.ndarray] | None = None
    for mode, flags in _decoder_modes(device, plan).items():
        states: list[Any] = []
        try:
            decoder = decoders.get(mode)
            if decoder is None:
                decoder = decoders[mode] = StreamingDecoder(snac, max_streams=max(plan.decoder_batches), **flags)
            states = [decoder.new_state() for _ in range(batch)]
            k = 0

            def tick(decoder: Any = decoder, states: list[Any] = states) -> list[Any]:
                nonlocal k
                for st, f in zip(states, frames):
                    st.pending.append(f[k % 64 : k % 64 + 1])
                k += 1
                return decoder.decode(states) if states[0].ready(decoder.first_chunk_frames) else []

            t = time.perf_counter()
            while k < decoder.first_chunk_frames:
                tick()
            audio = tick()  # the first steady tick: the same audio in every mode
            _sync()
            row[f"{mode}_first_ticks_s"] = time.perf_counter() - t
            if first is None:
                first = audio
            else:
                row[f"{mode}_max_diff_vs_eager_int16"] = max(
                    int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(audio, first)
                )
            tick_s = _median_tick_s(tick, plan.decoder_ticks, tick_budget)
            row[f"{mode}_ms_per_tick"] = tick_s * 1e3
            row[f"{mode}_frames_per_s"] = batch / tick_s
            row[f"{mode}_x_rt"] = audio_s / tick_s
        except Exception as exc:  # noqa: BLE001 - recorded; the other modes stand
            row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if mode in decoders:
                for st in states:
                    decoders[mode].release(st)
    windows = frames[:, :4]
    row["reference_eager_x_rt"] = audio_s / _median_tick_s(
        lambda: reference_decode(snac, windows), plan.decoder_ticks, tick_budget
    )
    if "eager_x_rt" in row:
        row["project_over_reference_eager"] = row["eager_x_rt"] / row["reference_eager_x_rt"]
    return row


def part_decoder(assets: dict[str, str], plan: Plan, clock: Clock, device: str) -> dict[str, Any]:
    """(a) Decoder throughput by batch size; x_rt = audio seconds decoded per wall second (real-time streams)."""
    from orpheus_tts_plugin.codec.snac import load_snac

    snac = load_snac(assets["snac"], device)
    decoders: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for batch in plan.decoder_batches:
        if clock.left() < plan.min_left_s:
            rows.append({"batch": batch, "skipped": "time budget"})
            continue
        rows.append(_decoder_batch(snac, decoders, batch, plan, clock, device))
    one = next((r for r in rows if r["batch"] == 1 and "skipped" not in r), None)
    return {
        "rows": rows,
        "reference_one_stream_at_a_time_x_rt": one["reference_eager_x_rt"] if one else None,
        "modes": list(_decoder_modes(device, plan)),
    }


# ------------------------------------------------------------------------------------ (b) backend


def _llama_config(plan: Plan) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=ENGLISH.vocab_size,
        max_position_embeddings=131072,
        rope_scaling=dict(ROPE_SCALING),
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5,
        bos_token_id=ENGLISH.bos,
        eos_token_id=ENGLISH.end_of_speech,
        pad_token_id=ENGLISH.pad,
        **dict(plan.llama),
    )


def build_llama(plan: Plan, device: str) -> torch.nn.Module:
    """A LlamaForCausalLM of the plan's shape with random weights, built directly on `device`."""
    from transformers import LlamaForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(_llama_config(plan))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def random_backend(
    model: torch.nn.Module, plan: Plan, device: str, max_batch_size: int, graphs: bool | None = None
) -> Any:
    """The project's HFBackend serving the preloaded random-weight `model` (no checkpoint on disk).

    graphs (default: on CUDA, as the engine does): captured steps on CUDA, the same static step eagerly on CPU.
    """
    from orpheus_tts_plugin.backends.hf import HFBackend

    cuda = device.startswith("cuda")
    graphs = cuda if graphs is None else graphs
    dtype = next(model.parameters()).dtype
    return HFBackend(
        model,
        device=device,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_seq_len=plan.max_seq_len,
        cuda_graphs=graphs and cuda,
        static_shapes=graphs,
    )


def graphs_match_eager(model: torch.nn.Module, plan: Plan, device: str, prompt: tuple[int, ...]) -> dict[str, Any]:
    """Tokens of one seeded request, 60 steps, captured (static) step vs eager step: how many lead alike.

    bf16 reductions may differ between the two (the static step attends over a length bucket), so a late
    divergence is numerics; an early one is a defect.
    """
    from orpheus_tts_plugin.backends.protocol import GenerationRequest
    from orpheus_tts_plugin.config import SamplingParams

    out: dict[str, list[int]] = {}
    for name, graphs in (("graphs", True), ("eager", False)):
        backend = random_backend(model, replace(plan, max_seq_len=512), device, 4, graphs)
        backend._load()
        req = GenerationRequest("check", prompt, SamplingParams(seed=7), 60, ())
        row = backend._admit(req)
        out[name] = [ids[0] for ids, _ in (backend._step([row])[0] for _ in range(60)) if ids]
        backend.model = None
    same = next((i for i, (a, b) in enumerate(zip(out["graphs"], out["eager"])) if a != b), len(out["eager"]))
    return {"check": "graphs_vs_eager_tokens", "same_leading_tokens": same, "of": len(out["eager"])}


def _time_of_token(arrivals: list[tuple[float, int]], n: int) -> float | None:
    """When the n-th token arrived (None if fewer came): 28 tokens make the first audio."""
    counts = np.cumsum([m for _, m in arrivals])
    i = int(np.searchsorted(counts, n))
    return arrivals[i][0] if i < len(arrivals) else None


async def _backend_point(backend: Any, prompt: tuple[int, ...], n: int, tokens: int, clock: Clock) -> dict[str, Any]:
    from orpheus_tts_plugin.backends.protocol import GenerationRequest
    from orpheus_tts_plugin.config import SamplingParams

    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(n)]

    async def one(i: int) -> None:
        req = GenerationRequest(f"c{n}-{i}", prompt, SamplingParams(), tokens, (ENGLISH.end_of_speech,))
        stream = backend.generate(req)
        try:
            async for ids in stream:
                arrivals[i].append((time.perf_counter(), len(ids)))
        finally:
            await stream.aclose()

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    _, pending = await asyncio.wait(tasks, timeout=max(1.0, clock.left()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    got = [a for a in arrivals if a]
    ttft = [a[0][0] - t0 for a in got]
    first_audio = [t - t0 for a in got if (t := _time_of_token(a, 28)) is not None]
    all_in = max(ttft) if ttft else 0.0
    end = max(a[-1][0] for a in got) if got else t0
    steady = sum(m for a in got for t, m in a if t > t0 + all_in)
    per_s = steady / (end - t0 - all_in) if end - t0 > all_in else None
    return {
        "concurrency": n,
        "completed": len(tasks) - len(pending),
        "ttft_p50_ms": float(np.median(ttft) * 1e3) if ttft else None,
        "ttft_p95_ms": float(np.percentile(ttft, 95) * 1e3) if ttft else None,
        "tokens28_p50_ms": float(np.median(first_audio) * 1e3) if first_audio else None,
        "tokens28_p95_ms": float(np.percentile(first_audio, 95) * 1e3) if first_audio else None,
        "tokens_per_s": per_s,
        "tokens_per_s_per_stream": per_s / n if per_s else None,
        "realtime": bool(per_s and per_s / n >= REALTIME_TOKENS_PER_S),
    }


def part_backend(assets: dict[str, Any], plan: Plan, clock: Clock, device: str) -> dict[str, Any]:
    """(b) hf backend, all requests at once per level: time to first token / first 28 tokens, steady tokens/s."""
    from transformers import AutoTokenizer

    from orpheus_tts_plugin.speech.prompt import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(assets["tokenizer"])
    prompt = prompt_ids(tokenizer, ENGLISH, "Thanks for calling. How can I help you today?", "tara")
    variants = {"graphs": plan.backend_concurrency, "eager": plan.eager_concurrency}  # graphs: static on CPU

    async def run(variant: str, levels: tuple[int, ...]) -> list[dict[str, Any]]:
        backend = random_backend(assets["llama"], plan, device, max(levels), graphs=variant == "graphs")
        t = time.perf_counter()
        await backend.start()  # with graphs: every (batch, length) bucket captured here
        rows: list[dict[str, Any]] = [{"variant": variant, "start_s": time.perf_counter() - t}]
        try:
            for n in levels:
                if clock.left() < plan.min_left_s:
                    rows.append({"variant": variant, "concurrency": n, "skipped": "time budget"})
                    continue
                point = await _backend_point(backend, prompt, n, plan.backend_tokens, clock)
                rows.append({"variant": variant, **point})
        finally:
            await backend.close()
        return rows

    rows: list[dict[str, Any]] = []
    try:
        rows.append(graphs_match_eager(assets["llama"], plan, device, prompt))
    except Exception as exc:  # noqa: BLE001 - recorded; the timings still run
        rows.append({"check": "graphs_vs_eager_tokens", "error": f"{type(exc).__name__}: {exc}"})
    for variant, levels in variants.items():
        try:
            rows += asyncio.run(run(variant, levels))
        except Exception as exc:  # noqa: BLE001 - recorded; the other variant's figures stand
            rows.append({"variant": variant, "error": f"{type(exc).__name__}: {exc}"})
    return {"prompt_tokens": len(prompt), "new_tokens": plan.backend_tokens, "rows": rows}


# ------------------------------------------------------------------------------------ (c) engine


def part_engine(assets: dict[str, Any], plan: Plan, clock: Clock, device: str) -> dict[str, Any]:
    """(c) `bench engine` (constant traffic, project decoder) one level at a time while the budget lasts."""
    from orpheus_tts_plugin.tools.bench import engine as bench_engine
    from orpheus_tts_plugin.tools.bench.figures import capacity

    points: list[dict[str, Any]] = []
    skipped: list[int] = []
    base = bench_engine.BenchOptions(
        backend="hf",
        model=assets["tokenizer"],  # the tokenizer; the backend is the random-weight one below
        snac=assets["snac"],
        device=device,
        duration_s=plan.engine_duration_s,
        budget_per_char=plan.engine_budget_per_char,
        progress=False,
    )
    for n in plan.engine_streams:
        if clock.left() < max(plan.min_left_s, 2.5 * plan.engine_duration_s):
            skipped.append(n)
            continue
        opts = replace(base, streams=(n,), drain_s=min(plan.engine_duration_s, max(1.0, clock.left() / 3)))
        result = bench_engine.run(opts, lambda n=n: random_backend(assets["llama"], plan, device, max(n, 1)))
        points.extend(result["points"])
    return {"options": asdict(base), "points": points, "capacity": capacity(points), "skipped_streams": skipped}


# ------------------------------------------------------------------------------------ driver

PARTS = {"decoder": part_decoder, "backend": part_backend, "engine": part_engine}


def make_assets(tmp: Path, plan: Plan, device: str, reuse: str | None) -> dict[str, Any]:
    """Tokenizer (the test model's: real Orpheus ids), SNAC of the plan's size and the random Llama."""
    from orpheus_tts_plugin.tools.testmodel import make_test_model

    if reuse is None:
        make_test_model(tmp, snac=plan.snac)
        reuse = str(tmp)
    return {"tokenizer": f"{reuse}/orpheus", "snac": f"{reuse}/snac", "llama": build_llama(plan, device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device: seconds (CI)")
    p.add_argument("--out", default="gpu-bench.json")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--budget-s", type=float, default=540.0, help="whole run, setup included")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of decoder, backend, engine")
    p.add_argument("--assets", default=None, help="an `orpheus-tts make-test-model` dir to reuse (SNAC, tokenizer)")
    args = p.parse_args(argv)
    plan = SMOKE if args.smoke else Plan()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(args.budget_s)
    result: dict[str, Any] = {"bench": "gpu", "meta": run_metadata(), "smoke": args.smoke, "device": device}
    result["plan"] = asdict(plan)
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        assets = make_assets(Path(tmp), plan, device, args.assets)
        result["setup_s"] = time.monotonic() - clock.start
        budgets = dict(plan.budgets_s)
        for name in args.parts.split(","):
            clock.begin(budgets[name])
            t = time.monotonic()
            print(f"[{t - clock.start:.0f} s] part {name}", flush=True)
            try:
                result[name] = PARTS[name](assets, plan, clock, device)
            except Exception:  # noqa: BLE001 - one broken part must not lose the others' figures
                errors.append(f"{name}: {traceback.format_exc()}")
                result[name] = {"error": traceback.format_exc(limit=-3)}
            result[name]["elapsed_s"] = time.monotonic() - t
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
            _print({name: result[name]})
            if "error" in result[name]:
                print(f"({name}) failed: {result[name]['error']}", flush=True)
            write_json({**result, "errors": errors}, args.out)  # a run killed later keeps the parts done
    result["elapsed_s"] = time.monotonic() - clock.start
    result["errors"] = errors
    write_json(result, args.out)
    print(f"wrote {args.out} in {result['elapsed_s']:.0f} s" + (f"; {len(errors)} part(s) failed" if errors else ""))
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


def _print(result: dict[str, Any]) -> None:
    """The table of each part in `result` (the engine's in `bench engine`'s columns)."""
    from orpheus_tts_plugin.tools.bench.figures import COLUMNS

    for name in PARTS:
        part = result.get(name, {})
        rows = part.get("rows") or part.get("points")
        if rows:
            print(f"\n({name})")
            print_rows(rows, COLUMNS if name == "engine" else {k: k for r in rows for k in r})


if __name__ == "__main__":
    sys.exit(main())
