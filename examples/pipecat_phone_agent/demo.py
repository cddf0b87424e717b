"""The phone agent end to end on one machine, offline: server + simulated Twilio callers, then a report.

    python -m examples.pipecat_phone_agent.demo [--calls 4] [--max-calls N] [--out out/phone-agent]
        [--tts serve|inprocess|both] [--no-pin]

Makes what it needs if missing (the random-weight test model from `orpheus-tts make-test-model`, the
caller's speech from espeak-ng), starts the server (pocketsphinx STT, the offline responder, Orpheus
on the test model, one engine for all calls), places the calls at once over real WebSockets (each dialed
through the agent's TwiML webhook, which refuses the calls past its `--max-calls` as busy), and writes a
stereo WAV per admitted call plus a JSON report of the latencies the callers measured, each turn's
latency waterfall (`stages_ms`) and a chart of it, and the gaps in the agent's audio. By default the agent
speaks through a local `orpheus-tts serve` process (RemoteEngine), one engine process for the machine: on a
CPU host the engine's steps are many small torch ops, each taking the GIL, and in the agent's own process
they and four calls' Pipecat pipelines share one interpreter lock (the process stays under one core while
the TTS falls behind). `--tts inprocess` runs the engine in the agent's process; `both` runs both ways.
With two or more CPUs the agent runs on the first and `serve` on the last (`--cpus`; `--no-pin` to let them
float): a process's threads take turns on one lock, and spread over CPUs each turn wakes another CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orpheus_tts_plugin.runtime.affinity import allowed_cpus
from orpheus_tts_plugin.tools.loopback import free_port

from .caller import CallScript, print_summary, run_calls
from .make_fixtures import load_fixtures
from .waterfall import add_stages, medians, plot, print_medians, speculations, split_turns

REPO_ROOT = Path(__file__).resolve().parents[2]


def ensure_test_model(directory: Path, snac: str = "tiny") -> Path:
    """`orpheus-tts make-test-model DIR --snac SNAC`, unless DIR already holds one."""
    if not (directory / "orpheus" / "config.json").exists() or not (directory / "snac").exists():
        from orpheus_tts_plugin.tools.testmodel import make_test_model

        make_test_model(directory, snac=snac)
    return directory


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def settled_stats(base: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's /stats once it has finished tearing down the calls that hung up (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (stats := get_json(f"{base}/stats"))["calls"]["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


def http_ok(url: str) -> bool:
    """Whether GET `url` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def running(cmd: list[str], ready_url: str, log_path: Path, start_timeout: float = 300.0) -> Iterator[None]:
    """Run `cmd` (from the repository root, output to `log_path`) until the block ends, once `ready_url` answers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # One torch thread per process unless told otherwise: the test model's ops are too small to split, and
    # idle OpenMP threads spin on the cores the other processes (callers, agent, recognizers) need.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + start_timeout
        while not http_ok(ready_url):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[2]} exited ({proc.returncode}); see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd[2]} not up after {start_timeout:.0f} s; see {log_path}")
            time.sleep(0.25)
        yield
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: stop now, without a drain
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def agent_server(server_args: list[str], log_path: Path, start_timeout: float = 300.0) -> Iterator[str]:
    """Run the phone agent server on a free loopback port until the block ends; yields its http:// base URL (its
    TwiML answers with its ws:// media stream URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "examples.pipecat_phone_agent.server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--public-url", f"ws://127.0.0.1:{port}/ws"]
    base = f"http://127.0.0.1:{port}"
    with running([*cmd, *server_args], f"{base}/stats", log_path, start_timeout):  # once engine and STT loaded
        yield base


@contextlib.contextmanager
def tts_server(serve_args: list[str], log_path: Path) -> Iterator[str]:
    """Run `orpheus-tts serve` on a free loopback port until the block ends; yields its ws:// URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "orpheus_tts_plugin.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with running([*cmd, *serve_args], f"http://127.0.0.1:{port}/ready", log_path):  # once the engine has loaded
        yield f"ws://127.0.0.1:{port}"


def cpu_steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this VM's CPUs since boot (/proc/stat `steal`; None off Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else None


def pinned_cpus() -> tuple[list[str], list[str]]:
    """`--cpus` for the agent (the first CPU) and for `serve` (the last): each process's threads share one
    interpreter lock, and spread over CPUs every hand-off of it wakes another (on a VM, a halted vCPU)."""
    cpus = sorted(allowed_cpus())
    if len(cpus) < 2:
        return [], []
    return ["--cpus", str(cpus[0])], ["--cpus", str(cpus[-1])]


def run_demo(
    out: Path,
    server_args: list[str],
    calls: int = 4,
    script: CallScript | None = None,
    name: str = "",
    stagger_s: float = 0.25,
    observe: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, Any]:
    """Start the server, place `calls` simulated calls (dialed `stagger_s` apart), return (and write) the report.

    `name` suffixes what the run writes (report{name}.json, calls{name}/, waterfall{name}.png, server{name}.log);
    `observe()` is entered while the calls run, the server up (scripts/capacity_curve.py measures CPU in it).
    """
    lines = load_fixtures(out / "fixtures")
    script = script or CallScript(question=lines["question"], barge_in=lines["barge_in"])
    with agent_server(server_args, out / f"server{name}.log") as base:
        stolen = cpu_steal_s()
        with observe():
            report = asyncio.run(run_calls(f"{base}/twiml", script, out / f"calls{name}", calls, stagger_s))
        report["host_cpu_steal_s"] = None if stolen is None else round(cpu_steal_s() - stolen, 2)
        report["server"] = settled_stats(base)
        sids = [c["stream_sid"] for c in report["calls"] if "stream_sid" in c]  # a <Reject>ed call has none
        add_stages(report, {sid: get_json(f"{base}/calls/{sid}/moments") for sid in sids})
    report["stage_medians_ms"] = medians(report)
    report["split_turns"] = split_turns(report)
    report["speculations"] = speculations(report)
    report["server_log"] = str(out / f"server{name}.log")
    report["waterfall_png"] = str(out / f"waterfall{name}.png")
    report["calls_dir"] = str(out / f"calls{name}")
    plot(report, out / f"waterfall{name}.png", title=f"latency per turn ({name.strip('-') or 'in-process'} TTS)")
    (out / f"report{name}.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the demo; Ctrl-C stops it and its servers at once, with one line and status 130."""
    try:
        return demo(argv)
    except KeyboardInterrupt:
        print("phone demo: interrupted", file=sys.stderr, flush=True)
        return 130


def demo(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/phone-agent", help="where the model, fixtures, WAVs and report go")
    parser.add_argument("--calls", type=int, default=4, help="simulated calls placed at once")
    parser.add_argument(
        "--max-calls",
        type=int,
        default=None,
        metavar="N",
        help="the agent's capacity (its --max-calls; default: the agent's own); calls past it are refused as busy",
    )
    parser.add_argument("--snac", choices=("tiny", "full"), default="tiny", help="test model's SNAC size")
    parser.add_argument("--max-tokens", type=int, default=300, help="audio tokens per sentence (~3.6 s)")
    parser.add_argument(
        "--tts",
        choices=("serve", "inprocess", "both"),
        default="serve",
        help="the engine behind `orpheus-tts serve` (its own process), in the agent's process, or both in turn",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with 2 or more CPUs: the agent on the first, `serve` on the last, recognizers and callers anywhere",
    )
    parser.add_argument(
        "--first-phrase-words",
        type=int,
        default=None,
        metavar="N",
        help="the agent speaks each reply from its first clause mark after N words (off: its first sentence)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to the agent server, e.g. --server-arg=--user-speech-timeout=0.3",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    model = ensure_test_model(out / "test-model", args.snac)
    weights = ("--model", str(model / "orpheus"), "--snac", str(model / "snac"), "--backend", "hf", "--device", "cpu")
    agent_cpus, serve_cpus = pinned_cpus() if args.pin else ([], [])
    server_args = [
        *weights,
        *("--stt", "pocketsphinx", "--llm", "offline", "--max-tokens", str(args.max_tokens)),
        *agent_cpus,
        *([] if args.first_phrase_words is None else ["--first-phrase-words", str(args.first_phrase_words)]),
        *([] if args.max_calls is None else ["--max-calls", str(args.max_calls)]),
        *args.server_arg,
    ]
    runs: dict[str, dict[str, Any]] = {}
    if args.tts in ("inprocess", "both"):
        runs["in-process"] = run_demo(out, server_args, calls=args.calls)
    if args.tts in ("serve", "both"):
        with tts_server([*weights, "--max-streams", "64", *serve_cpus], out / "tts-serve.log") as url:
            runs["serve"] = run_demo(out, [*server_args, "--tts-url", url], calls=args.calls, name="-serve")
    for name, report in runs.items():
        print(f"--- {name} TTS")
        print_summary(report)
        if report["host_cpu_steal_s"] is not None:  # a VM's neighbours: the demo's figures move with it
            print(f"host CPU stolen by the hypervisor during the calls: {report['host_cpu_steal_s']:.1f} s")
        print(f"caller turns ended too early (at a mid-sentence pause): {report['split_turns']}")
        spec, engine = report["speculations"], report["server"]["engine"]
        per_call = ", ".join(
            f"{c['speculations']['started']}/{c['speculations']['confirmed']}/{c['speculations']['discarded']}"
            for c in report["calls"]
        )
        print(
            f"speculations (reply spoken ahead, held until the turn is confirmed): {spec['started']} started, "
            f"{spec['confirmed']} confirmed, {spec['discarded']} discarded (per call: {per_call}); engine work "
            f"discarded: {engine.get('speculative_discarded_audio_s', 0):.2f} s of audio"
        )
        engine, calls = report["server"]["engine"], report["server"]["calls"]
        print(
            f"agent: capacity {calls['capacity']} calls, {calls['refused']} refused; "
            f"engine: {calls['total']} calls, {engine.get('streams_started', 0)} streams, "
            f"{engine.get('streams_cancelled', 0)} cancelled (barge-in or hang-up), "
            f"{engine['active_streams']} still active"
        )
    print_medians({name: report["stage_medians_ms"] for name, report in runs.items()})
    for name, report in runs.items():
        suffix = "-serve" if name == "serve" else ""
        print(
            f"{name}: report {out / f'report{suffix}.json'}, waterfall {report['waterfall_png']}, "
            f"recordings (left: caller, right: agent as heard) {report['calls_dir']}/call-*.wav"
        )
    return 0 if all(c["error"] is None for report in runs.values() for c in report["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
