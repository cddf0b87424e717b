"""The phone agent's capacity curve (issue 49): what N concurrent calls get from one agent process, with the engine on
the CPU test model and as on a GPU, and what each call costs in CPU, by process.

    .venv/bin/python scripts/capacity_curve.py [--calls 2,4,6,8,12,16] [--engine cpu-model,gpu-like]
        [--out out/capacity]

Each point is one run of the demo (`demo.run_demo`: the same simulated callers, report, WAVs and waterfall) with the
agent's `--max-calls` at N, so every call is admitted: the curve is what admitted calls get past the knee. The two
engine modes, both behind one `orpheus-tts serve` on the last CPU (the agent on the first):

- `cpu-model`: the random-weight test model on the hf backend (the demo as it ships): the engine's CPU competes
  with the agent's, so it shows this box, not a GPU box;
- `gpu-like`: the synthetic backend paced at `--token-rate` tokens/s a stream (default 150: an H100 serving its
  published ~216 real-time streams runs each at 84 tokens/s or more, faster at fewer streams), decoding on the tiny
  SNAC: the engine takes no agent CPU, as on a GPU box, so the agent's own CPU sets the knee.

CPU per call comes from each process's CPU time (user + system) over the calls, not wall time: the agent process
(Pipecat's pipelines, Silero VAD, our TTS service and client), its recognizer workers (pocketsphinx), the engine
(`serve`) and the simulated callers (this process). The knee is the largest N with 0 gaps over 100 ms and a
voice-to-voice p95 of 1.2 s or less. Writes capacity.json, capacity.md (the table) and capacity.png.

`--profile N` also samples the agent process with py-spy (`pip install py-spy`; on-CPU samples only) during the N-call
run and splits its CPU by stage: each sample goes to the innermost frame of a known part (ours, Silero VAD,
resampling, transport, aggregators, the recognizer client, the rest of Pipecat, asyncio and threads); samples of a
thread waiting (a select, a pool thread's queue, a condition) are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.pipecat_phone_agent.demo import ensure_test_model, pinned_cpus, run_demo, tts_server  # noqa: E402
from orpheus_tts_plugin.tools.bench.common import host_line  # noqa: E402

KNEE_P95_MS = 1200.0
ROLES = ("agent", "recognizers", "engine", "callers")


def role_of(proc: psutil.Process, agent_pid: int | None) -> str | None:
    """Which part of the run a process is: the agent server, one of its children (recognizers), `serve`, us."""
    try:
        cmdline = " ".join(proc.cmdline())
        parents = {p.pid for p in proc.parents()}
    except psutil.Error:
        return None
    if proc.pid == psutil.Process().pid:
        return "callers"
    if "examples.pipecat_phone_agent.server" in cmdline:
        return "agent"
    if agent_pid is not None and agent_pid in parents:
        return "recognizers"
    if "orpheus_tts_plugin.cli serve" in cmdline:
        return "engine"
    return None


class CpuByRole:
    """CPU seconds each role's processes spent while entered: sampled every `period_s` (processes may start late)."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.first: dict[int, tuple[str, float]] = {}  # pid → (role, CPU s when first seen); the sampler thread's
        self.last: dict[int, float] = {}  # pid → CPU s when last seen; the sampler thread's
        self.wall_s = 0.0  # how long it was entered
        self._stop = threading.Event()

    def _sample(self) -> None:
        procs = list(psutil.process_iter())
        agent = next((p.pid for p in procs if role_of(p, None) == "agent"), None)
        for proc in procs:
            role = role_of(proc, agent)
            if role is None:
                continue
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            spent = times.user + times.system
            self.first.setdefault(proc.pid, (role, spent))
            self.last[proc.pid] = spent

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self._stop.clear()
        self.first.clear()
        self.last.clear()
        self._sample()
        began = time.monotonic()
        thread = threading.Thread(target=self._run, name="cpu-by-role", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self._sample()
            self.wall_s = time.monotonic() - began

    def seconds(self) -> dict[str, float]:
        out = dict.fromkeys(ROLES, 0.0)
        for pid, (role, first) in self.first.items():
            out[role] += self.last.get(pid, first) - first
        return out


# (stage, path fragments): a sample's stage is that of its innermost frame matching any fragment, in this order.
STAGES = (
    ("ours: orpheus_tts_plugin", ("orpheus_tts_plugin/",)),
    ("Silero VAD", ("silero", "onnxruntime", "vad_analyzer")),
    ("resampling", ("resampler", "soxr")),
    ("transport and serializer", ("pipecat/transports", "pipecat/serializers", "starlette", "uvicorn", "websockets")),
    ("aggregators", ("pipecat/processors/aggregators",)),
    ("recognizer client", ("pipecat_phone_agent/offline_stt",)),
    ("rest of Pipecat", ("pipecat/",)),
    ("asyncio and threads", ("asyncio/", "concurrent/futures", "threading.py", "selectors.py")),
)


# Leaves of a thread that waits (py-spy counts some of them as running): the event loop's select, a pool thread's
# queue get (`_worker` itself at the leaf: the get is in C), a condition or event wait.
IDLE_LEAVES = ("Selector.select (", "_worker (concurrent/futures/thread.py", "Condition.wait (", "Event.wait (")


def stage_of(stack: str) -> str:
    frames = stack.split(";")
    if any(leaf in frames[-1] for leaf in IDLE_LEAVES):
        return "idle"
    for frame in reversed(frames):
        for stage, fragments in STAGES:
            if any(f in frame for f in fragments):
                return stage
    return "other"


@contextlib.contextmanager
def profiled(raw_path: Path) -> Iterator[None]:
    """py-spy samples the agent process (found by its command line) until the block ends, into `raw_path`."""
    import signal
    import subprocess

    agent = next(p.pid for p in psutil.process_iter() if role_of(p, None) == "agent")
    spy_bin = str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy_bin, "record", "--pid", str(agent), "--format", "raw", "--rate", "200", "--output", str(raw_path)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


def stage_shares(raw_path: Path) -> dict[str, float]:
    """Each stage's share of the agent's on-CPU samples, from py-spy's raw (collapsed) output."""
    counts: dict[str, int] = {}
    for line in raw_path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[stage_of(stack)] = counts.get(stage_of(stack), 0) + int(n)
    idle = counts.pop("idle", 0)
    total = sum(counts.values()) or 1
    shares = {stage: round(n / total, 3) for stage, n in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {**shares, "idle samples left out": round(idle / (total + idle), 3)}


def point(report: dict[str, Any], cpu: dict[str, float], calls: int, seconds: float) -> dict[str, Any]:
    """One row of the curve from a demo report and the CPU the run's processes spent."""
    v2v = report["summary"].get("speech_end_to_agent_audio_ms", {})
    greeting = report["summary"].get("greeting_ms", {})
    failed = sum(1 for c in report["calls"] if c.get("error"))
    return {
        "calls": calls,
        "v2v_p50_ms": v2v.get("median"),
        "v2v_p95_ms": v2v.get("p95"),
        "gaps": report["agent_audio_gaps_over_100ms"],
        "cut_turns": report["split_turns"],
        "failed_calls": failed,
        "greeting_p50_ms": greeting.get("median"),
        "seconds": round(seconds, 1),
        "cpu_per_call_s": {role: round(s / calls, 2) for role, s in cpu.items()},
        "cpu_cores": {role: round(s / seconds, 2) for role, s in cpu.items()},
    }


def knee(points: list[dict[str, Any]]) -> int | None:
    """The largest N with 0 gaps, no failed call and a voice-to-voice p95 of at most 1.2 s."""
    good = [
        p["calls"]
        for p in points
        if p["gaps"] == 0 and not p["failed_calls"] and (p["v2v_p95_ms"] or 1e9) <= KNEE_P95_MS
    ]
    return max(good, default=None)


def serve_args(mode: str, model: Path, token_rate: float) -> list[str]:
    snac = ("--snac", str(model / "snac"), "--device", "cpu", "--max-streams", "64")
    if mode == "cpu-model":
        return ["--model", str(model / "orpheus"), "--backend", "hf", *snac]
    return ["--model", str(model / "orpheus"), "--backend", "synthetic", "--token-rate", str(token_rate), *snac]


def table(curves: dict[str, list[dict[str, Any]]]) -> str:
    head = "| engine | calls | v2v p50 / p95 (ms) | gaps | cut turns | failed | greeting p50 (ms) | CPU s per call: "
    head += "agent / recognizers / engine / callers |\n|---|---|---|---|---|---|---|---|\n"
    rows = []
    for mode, points in curves.items():
        for p in points:
            cpu = p["cpu_per_call_s"]
            rows.append(
                f"| {mode} | {p['calls']} | {p['v2v_p50_ms']:.0f} / {p['v2v_p95_ms']:.0f} | {p['gaps']} | "
                f"{p['cut_turns']} | {p['failed_calls']} | {p['greeting_p50_ms']:.0f} | "
                f"{cpu['agent']:.2f} / {cpu['recognizers']:.2f} / {cpu['engine']:.2f} / {cpu['callers']:.2f} |"
            )
    knees = ", ".join(f"{mode}: {knee(points)}" for mode, points in curves.items())
    return head + "\n".join(rows) + f"\n\nKnee (0 gaps, p95 <= 1.2 s): {knees}.\n"


def plot(curves: dict[str, list[dict[str, Any]]], path: Path, host: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, points in curves.items():
        n = [p["calls"] for p in points]
        ax.plot(n, [p["v2v_p50_ms"] for p in points], "o-", label=f"{mode} p50")
        ax.plot(n, [p["v2v_p95_ms"] for p in points], "s--", label=f"{mode} p95")
        gx.plot(n, [p["gaps"] for p in points], "o-", label=mode)
    ax.axhline(KNEE_P95_MS, color="grey", lw=0.8)
    ax.set(xlabel="concurrent calls (one agent process)", ylabel="voice-to-voice (ms)", yscale="log")
    gx.set(xlabel="concurrent calls", ylabel="agent audio gaps over 100 ms")
    ax.legend(fontsize=8)
    gx.legend(fontsize=8)
    fig.suptitle(f"phone agent capacity: {host}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", default="2,4,6,8,12,16", help="the N to run, comma-separated")
    parser.add_argument("--engine", default="cpu-model,gpu-like", help="cpu-model, gpu-like or both")
    parser.add_argument("--token-rate", type=float, default=150.0, help="gpu-like: tokens/s a stream")
    parser.add_argument("--out", default="out/capacity")
    parser.add_argument("--profile", type=int, default=None, metavar="N", help="py-spy the agent at N calls")
    args = parser.parse_args(argv)
    out = Path(args.out)
    demo_out = out / "demo"  # the demo's model, fixtures, WAVs and reports, one set per point
    model = ensure_test_model(demo_out / "test-model", "tiny")
    agent_cpus, serve_cpus = pinned_cpus()
    agent_args = [
        *("--model", str(model / "orpheus"), "--snac", str(model / "snac"), "--device", "cpu"),
        *("--stt", "pocketsphinx", "--llm", "offline", "--max-tokens", "300"),
        *agent_cpus,
    ]
    host = host_line()
    curves: dict[str, list[dict[str, Any]]] = {}
    for mode in args.engine.split(","):
        curves[mode] = []
        with tts_server([*serve_args(mode, model, args.token_rate), *serve_cpus], out / f"serve-{mode}.log") as url:
            for n in (int(x) for x in args.calls.split(",")):
                cpu = CpuByRole()
                raw = out / f"agent-{mode}-{n}.pyspy.txt"

                @contextlib.contextmanager
                def observe(n: int = n, raw: Path = raw, cpu: CpuByRole = cpu) -> Iterator[None]:
                    with cpu(), profiled(raw) if n == args.profile else contextlib.nullcontext():
                        yield

                report = run_demo(
                    demo_out,
                    [*agent_args, "--tts-url", url, "--max-calls", str(n)],
                    calls=n,
                    name=f"-{mode}-{n}",
                    observe=observe,
                )
                row = point(report, cpu.seconds(), n, cpu.wall_s)
                if n == args.profile:
                    row["agent_cpu_by_stage"] = stage_shares(raw)
                curves[mode].append(row)
                print(json.dumps({"engine": mode, **row}), flush=True)
    (out / "capacity.json").write_text(json.dumps({"host": host, "curves": curves}, indent=2))
    (out / "capacity.md").write_text(f"Host: {host}\n\n" + table(curves))
    plot(curves, out / "capacity.png", host)
    print(table(curves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
