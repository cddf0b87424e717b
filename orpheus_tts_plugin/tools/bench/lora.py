"""`orpheus-tts bench lora`: what LoRA adapters cost the hf backend's decode step, side by side.

Three configurations of the same model at each batch size: `none` (no adapter configured: nothing hooked),
`lora-base` (the adapters configured, every row on the base model) and `lora-half` (the adapters configured,
every other row on an adapter, alternating between them). Timed as `bench backend` times its points (admit,
2 warm-up steps, `--steps` timed steps, tokens/s the median of 3 rounds, configurations alternating round by
round), eagerly and with the static-shape step that CUDA graphs capture (`--static`). Without `--adapter`, two
random adapters of rank `--rank` (`write_lora_adapter`) are written to a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from .backend import ROUNDS, WARMUP_STEPS, median_round, prompt_ids, time_steps
from .common import print_rows, run_metadata, write_json

CONFIGS = ("none", "lora-base", "lora-half")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `bench lora` flags."""
    p.add_argument("--model", required=True, help="model dir or hub id")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="default: 2 random ones")
    p.add_argument("--rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument(
        "--batch",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(1, 4, 16),
        help="batch sizes, e.g. 1,4,16",
    )
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per point")
    p.add_argument("--static", action="store_true", help="the static-shape step (what CUDA graphs capture)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")


def main(args: argparse.Namespace) -> int:
    import torch

    from ...backends.hf import HFBackend

    torch.set_num_threads(args.threads)
    batches = sorted(set(args.batch))
    cuda = args.device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(args.device)) if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = dict(item.split("=", 1) for item in args.adapter) or _random_adapters(args.model, tmp, args.rank)
        names = sorted(adapters)
        seq = len(prompt_ids(0)) + WARMUP_STEPS + args.steps + 2
        options: dict[str, Any] = {"device": args.device, "max_batch_size": max(batches), "max_seq_len": seq}
        options["static_shapes"] = args.static
        plain = HFBackend(args.model, **options)
        lora = HFBackend(args.model, adapters=adapters, **options)  # its own copy of the model: hooks change it
        for backend in (plain, lora):
            backend._load()
    runs = {"none": (plain, None), "lora-base": (lora, None), "lora-half": (lora, names)}
    result: dict[str, Any] = {
        "bench": "lora",
        "meta": run_metadata(),
        "model": args.model,
        "adapters": {name: str(path) for name, path in adapters.items()},
        "rank": None if args.adapter else args.rank,
        "device": args.device,
        "static": args.static,
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "batch": {},
    }
    table = []
    for batch in batches:
        rounds: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
        for _ in range(ROUNDS):
            for config, (backend, use) in runs.items():
                adapter_of = None if use is None else (lambda i, use=use: use[(i // 2) % len(use)] if i % 2 else None)
                rounds[config].append(time_steps(backend, batch, args.steps, sync, adapter_of))
        point = {c: median_round(r) for c, r in rounds.items()}
        result["batch"][str(batch)] = point
        row: dict[str, Any] = {"batch": batch, **{c: point[c]["tokens_per_s"] for c in CONFIGS}}
        row.update({f"{c}/none": point[c]["tokens_per_s"] / point["none"]["tokens_per_s"] for c in CONFIGS[1:]})
        table.append(row)
    columns = {"batch": "rows", **{c: f"{c} tok/s" for c in CONFIGS}, **{f"{c}/none": f"{c}/none" for c in CONFIGS[1:]}}
    print_rows(table, columns)
    write_json(result, args.json)
    return 0


def _random_adapters(model: str, tmp: str, rank: int) -> dict[str, str]:
    """Two random adapters of `model` (a local folder) in `tmp`."""
    from ..testmodel import write_lora_adapter

    out = {}
    for i, name in enumerate(("a", "b")):
        out[name] = str(Path(tmp) / name)
        write_lora_adapter(model, out[name], rank=rank, alpha=2.0 * rank, seed=1 + i)
    return out
