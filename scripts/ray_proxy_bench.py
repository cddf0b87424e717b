"""What Ray Serve's proxy adds to time to first audio, for docs/benchmarks.md: one engine config served twice on
this host, by `orpheus-tts serve` (a process of its own, the client's multiplexed WebSocket) and by one Ray Serve
replica behind Ray's proxy (a local one-node Ray, the client's per-stream HTTP posts), asked alternately.

    .venv/bin/python scripts/ray_proxy_bench.py --snac DIR [--rounds 30] [--streams 1,8]

DIR: `orpheus-tts make-test-model DIR --snac tiny` then DIR/snac. The synthetic backend, unpaced, on the tiny SNAC.
Each round runs one batch of N concurrent streams on each side, the side that goes first alternating, so that a
busy moment of the host falls on both alike; a point is at least 30 requests a side. TTFB: `synthesize` called
→ its first chunk in the caller's loop. Also the CPU time each server process spends a stream (`serve`'s process;
Ray's replica and proxy actors), read from /proc around each side's batches: what the proxy costs a host.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import serve

from orpheus_tts_plugin import RemoteEngine
from orpheus_tts_plugin.server.ray import app
from orpheus_tts_plugin.tools.bench.common import host_line
from orpheus_tts_plugin.tools.loopback import free_port

TEXT = "Hello there. How are you today?"


def engine_args(snac: str, max_streams: int) -> dict[str, Any]:
    """The one engine config both sides serve (`serve`'s flags)."""
    return {"backend": "synthetic", "model": "", "snac": snac, "device": "cpu", "token_rate": 0.0,
            "max_streams": max_streams}  # fmt: skip


async def batch(remote: RemoteEngine, streams: int, seed: int) -> list[float]:
    """TTFB of `streams` concurrent streams, each heard to its end."""

    async def one(i: int) -> float:
        asked = time.perf_counter()
        speech = remote.synthesize(TEXT, seed=seed + i)
        first = 0.0
        async for _chunk in speech:
            first = first or time.perf_counter() - asked
        return first

    return list(await asyncio.gather(*(one(i) for i in range(streams))))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of these processes so far."""
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def ray_processes() -> dict[str, list[psutil.Process]]:
    """Ray's replica and proxy actor processes on this host, by their process titles."""
    found: dict[str, list[psutil.Process]] = {"replica": [], "proxy": []}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if "ServeReplica" in title:
            found["replica"].append(proc)
        elif "ProxyActor" in title:
            found["proxy"].append(proc)
    return found


async def measure(
    sides: dict[str, RemoteEngine], counts: list[int], rounds: int, procs: dict[str, dict[str, list[psutil.Process]]]
) -> None:
    for remote in sides.values():
        await remote.start()
        for _ in range(5):
            await batch(remote, max(counts), 0)  # warm-up: connections, the decoder's buckets
    names = list(sides)
    print(host_line())
    print(f"{'streams':>7} {'side':>12} {'n':>4} {'p50 ms':>8} {'p95 ms':>8}")
    for streams in counts:
        times: dict[str, list[float]] = {name: [] for name in names}
        spent = {(name, part): 0.0 for name in names for part in procs[name]}
        need = max(rounds, -(-30 // streams))
        for r in range(need):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                before = {part: cpu_s(ps) for part, ps in procs[name].items()}
                times[name] += await batch(sides[name], streams, 1000 * r)
                for part, ps in procs[name].items():
                    spent[name, part] += cpu_s(ps) - before[part]
        for name in names:
            t = times[name]
            per = ", ".join(f"{part} {1000 * spent[name, part] / len(t):.1f}" for part in procs[name])
            print(f"{streams:>7} {name:>12} {len(t):>4} {pct(t, 50):8.1f} {pct(t, 95):8.1f}   CPU ms a stream: {per}")
        d50 = pct(times[names[1]], 50) - pct(times[names[0]], 50)
        d95 = pct(times[names[1]], 95) - pct(times[names[0]], 95)
        print(f"{streams:>7} {'ray - serve':>12} {'':>4} {d50:+8.1f} {d95:+8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snac", required=True, help="the tiny SNAC of `orpheus-tts make-test-model DIR --snac tiny`")
    parser.add_argument("--rounds", type=int, default=30, help="batches a side per point (at least 30 requests)")
    parser.add_argument("--streams", default="1,8", help="concurrent streams per batch, e.g. 1,8")
    parser.add_argument("--max-streams", type=int, default=16)
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    options = engine_args(str(Path(args.snac).resolve()), args.max_streams)

    port = free_port()
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]
    cli = Path(sys.executable).parent / "orpheus-tts"
    direct = subprocess.Popen([str(cli), "serve", "--host", "127.0.0.1", "--port", str(port), *flags])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        ray_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
        # Both CPUs, as `serve` has them (Ray would otherwise set OMP_NUM_THREADS=1 in a replica of one CPU).
        ray_args = {**options, "min_replicas": 1, "max_replicas": 1, "cpus": 2}
        serve.run(app(ray_args), name="orpheus", route_prefix="/")
        sides = {
            "serve": RemoteEngine(f"ws://127.0.0.1:{port}", connect_timeout_s=60),
            "ray": RemoteEngine(f"ws://127.0.0.1:{ray_port}", connect_timeout_s=60),
        }
        procs = {"serve": {"serve": [psutil.Process(direct.pid)]}, "ray": ray_processes()}
        asyncio.run(_run(sides, counts, args.rounds, procs))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            direct.terminate()
            direct.wait(30)


async def _run(
    sides: dict[str, RemoteEngine], counts: list[int], rounds: int, procs: dict[str, dict[str, list[psutil.Process]]]
) -> None:
    try:
        await measure(sides, counts, rounds, procs)
    finally:
        await asyncio.gather(*(remote.aclose() for remote in sides.values()))


if __name__ == "__main__":
    main()
