"""`orpheus-tts bench backend`: tokens/s of the hf backend's decode step by batch size, reference vs fast sampler.

Each point admits `batch` audio-constrained requests (Orpheus-shaped prompts, Baseten's sampling defaults,
one seed per row), runs two warm-up steps, then times `steps` decode steps: tokens/s = batch x steps / wall
seconds, the median of three rounds (the variants alternate round by round, so they see the same machine
load; every round is in the JSON). All variants share one loaded model: `reference` (the sampler the fast
one replaced: all 28,673 audio logits, full sort), `fast` (per-position head, per-slot penalty, sort-free
nucleus) and, on CUDA only, `fast+graphs` (the same step captured per batch bucket; NOT RUN on the CPU build
machine). Plain transformers `generate` on the same model and batch is timed too (whole vocab, HF's
sampling; its prefill cancelled out by timing 1 and 1 + k new tokens, k < steps where a step takes long).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from ...config import SamplingParams
from ...spec import ENGLISH
from .common import print_rows, run_metadata, write_json

PROMPT_TEXT_IDS = 24
WARMUP_STEPS = 2
ROUNDS = 3
GENERATE_BUDGET_S = 15.0  # transformers generate: about this long at most per batch size
SAMPLING = SamplingParams()  # temperature 0.6, top_p 0.8, repetition penalty 1.1


def prompt_ids(row: int) -> tuple[int, ...]:
    """An Orpheus-shaped prompt (start of human, BOS, text, end of text/human, start of AI/speech), per row."""
    text = [(1_000 + 7_919 * (row * PROMPT_TEXT_IDS + i)) % 128_000 for i in range(PROMPT_TEXT_IDS)]
    return (ENGLISH.start_of_human, ENGLISH.bos, *text, *ENGLISH.prompt_suffix())


def time_steps(
    backend: Any,
    batch: int,
    steps: int,
    sync: Callable[[], None],
    adapter_of: Callable[[int], str | None] | None = None,
) -> dict[str, float]:
    """Admit `batch` requests (row i spoken by LoRA adapter `adapter_of(i)`, if given), warm up, time `steps`
    decode steps on this thread, release them."""
    from ...backends.protocol import GenerationRequest

    rows = []
    for i in range(batch):
        req = GenerationRequest(
            request_id=f"bench-{i}",
            prompt_ids=prompt_ids(i),
            sampling=SamplingParams(seed=i),
            max_new_tokens=10**6,
            stop_ids=(ENGLISH.end_of_speech,),
            constrain_audio=True,
            adapter=adapter_of(i) if adapter_of is not None else None,
        )
        rows.append(backend._admit(req))
    try:
        for _ in range(WARMUP_STEPS):
            backend._step(rows)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):  # a row that drew end of speech keeps stepping: the cost per step is what counts
            backend._step(rows)
        sync()
        wall = time.perf_counter() - t0
    finally:
        for row in rows:
            backend._release(row)
    return {"tokens_per_s": batch * steps / wall, "ms_per_step": 1e3 * wall / steps}


def median_round(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The round of median tokens/s, with every round's tokens/s."""
    mid = sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]
    return {**mid, "rounds_tokens_per_s": [r["tokens_per_s"] for r in rounds]}


def time_generate(model: Any, batch: int, steps: int, device: str, sync: Callable[[], None]) -> dict[str, Any]:
    """Plain transformers `generate` on the same model and batch: decode tokens/s, prefill cancelled out."""
    import torch

    ids = torch.tensor([prompt_ids(i) for i in range(batch)], device=device)
    kw = {
        "attention_mask": torch.ones_like(ids),
        "do_sample": True,
        "temperature": SAMPLING.temperature,
        "top_p": SAMPLING.top_p,
        "top_k": 0,
        "repetition_penalty": SAMPLING.repetition_penalty,
        "pad_token_id": ENGLISH.pad,
    }

    def run(new: int) -> float:
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        run(2)  # warm-up
        one = run(1)
        per_step = max(run(3) - one, 1e-6) / 2
        k = max(2, min(steps, int(GENERATE_BUDGET_S / per_step)))
        wall = max(run(1 + k) - one, 1e-9)
    return {"tokens_per_s": batch * k / wall, "ms_per_step": 1e3 * wall / k, "steps": k}


def variants(device: str) -> dict[str, tuple[type, dict[str, Any]]]:
    """The backend class and options of each timed variant."""
    from ...backends.hf import HFBackend
    from .reference_sampler import ReferenceHFBackend

    out: dict[str, tuple[type, dict[str, Any]]] = {"reference": (ReferenceHFBackend, {}), "fast": (HFBackend, {})}
    if device.startswith("cuda"):
        out["fast+graphs"] = (HFBackend, {"cuda_graphs": True})  # captured steps (CUDA only)
    return out


def main(args: argparse.Namespace) -> int:
    """Time every variant at every batch size, print a table, write JSON with the run's metadata."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    batches = sorted(set(args.batch))
    cuda = args.device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(args.device)) if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    seq = len(prompt_ids(0)) + WARMUP_STEPS + args.steps + 2
    backends = {}
    for name, (kind, options) in variants(args.device).items():
        backends[name] = kind(
            model, device=args.device, dtype=dtype, max_batch_size=max(batches), max_seq_len=seq, **options
        )
        backends[name]._load()
    result: dict[str, Any] = {
        "bench": "backend",
        "meta": run_metadata(),
        "backend": args.backend,
        "model": args.model,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "sampling": {"temperature": SAMPLING.temperature, "top_p": SAMPLING.top_p, "penalty": 1.1},
        "batch": {},
    }
    table = []
    for batch in batches:
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in backends}
        for _ in range(ROUNDS):
            for name, backend in backends.items():
                rounds[name].append(time_steps(backend, batch, args.steps, sync))
        point: dict[str, Any] = {name: median_round(r) for name, r in rounds.items()}
        point["transformers_generate"] = time_generate(model, batch, args.steps, args.device, sync)
        fast = point["fast"]["tokens_per_s"]
        point["fast_over_reference"] = fast / point["reference"]["tokens_per_s"]
        point["fast_over_generate"] = fast / point["transformers_generate"]["tokens_per_s"]
        result["batch"][str(batch)] = point
        table.append({"batch": batch, **{k: v["tokens_per_s"] for k, v in point.items() if isinstance(v, dict)}})
        table[-1].update(
            fast_over_reference=point["fast_over_reference"], fast_over_generate=point["fast_over_generate"]
        )
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.4g}" for k, v in table[-1].items() if k != "batch"), flush=True)
    columns = {"batch": "batch", **{name: f"{name} tok/s" for name in backends}}
    columns.update(
        transformers_generate="generate tok/s", fast_over_reference="fast/ref", fast_over_generate="fast/gen"
    )
    print_rows(table, columns)
    write_json(result, args.json)
    return 0
