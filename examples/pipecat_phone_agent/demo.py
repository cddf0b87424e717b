"""The phone agent end to end on one machine, offline: server + simulated Twilio callers, then a report.

    python -m examples.pipecat_phone_agent.demo [--calls 4] [--out out/phone-agent]

Makes what it needs if missing (the random-weight test model from `orpheus-tts make-test-model`, the
caller's speech from espeak-ng), starts the server (pocketsphinx STT, the offline responder, Orpheus
on the test model, one engine for all calls), places the calls at once over real WebSockets, and
writes a stereo WAV per call plus a JSON report of the latencies the callers measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .caller import CallScript, print_summary, run_calls
from .make_fixtures import load_fixtures

REPO_ROOT = Path(__file__).resolve().parents[2]


def ensure_test_model(directory: Path, snac: str = "tiny") -> Path:
    """`orpheus-tts make-test-model DIR --snac SNAC`, unless DIR already holds one."""
    if not (directory / "orpheus" / "config.json").exists() or not (directory / "snac").exists():
        from orpheus_tts_plugin.tools.testmodel import make_test_model

        make_test_model(directory, snac=snac)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def settled_stats(base: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's /stats once it has finished tearing down the calls that hung up (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (stats := get_json(f"{base}/stats"))["calls"]["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return stats


@contextlib.contextmanager
def agent_server(server_args: list[str], log_path: Path, start_timeout: float = 300.0) -> Iterator[str]:
    """Run the phone agent server on a free loopback port until the block ends; yields its http:// base URL."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "examples.pipecat_phone_agent.server", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, *server_args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:  # /stats answers once the engine and recognizer have loaded
            if proc.poll() is not None:
                raise RuntimeError(f"agent server exited ({proc.returncode}); see {log_path}")
            with contextlib.suppress(OSError):
                get_json(f"{base}/stats")
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent server not up after {start_timeout:.0f} s; see {log_path}")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_demo(out: Path, server_args: list[str], calls: int = 4, script: CallScript | None = None) -> dict[str, Any]:
    """Start the server, place `calls` simulated calls at once, return (and write) the report."""
    lines = load_fixtures(out / "fixtures")
    script = script or CallScript(question=lines["question"], barge_in=lines["barge_in"])
    with agent_server(server_args, out / "server.log") as base:
        ws_url = base.replace("http://", "ws://") + "/ws"
        report = asyncio.run(run_calls(ws_url, script, out / "calls", calls=calls))
        report["server"] = settled_stats(base)
    report["server_log"] = str(out / "server.log")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/phone-agent", help="where the model, fixtures, WAVs and report go")
    parser.add_argument("--calls", type=int, default=4, help="simulated calls placed at once")
    parser.add_argument("--snac", choices=("tiny", "full"), default="tiny", help="test model's SNAC size")
    parser.add_argument("--max-tokens", type=int, default=300, help="audio tokens per sentence (~3.6 s)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model = ensure_test_model(out / "test-model", args.snac)
    server_args = [
        *("--model", str(model / "orpheus"), "--snac", str(model / "snac"), "--backend", "hf", "--device", "cpu"),
        *("--stt", "pocketsphinx", "--llm", "offline", "--max-tokens", str(args.max_tokens)),
    ]
    report = run_demo(out, server_args, calls=args.calls)
    print_summary(report)
    engine = report["server"]["engine"]
    print(
        f"engine: {report['server']['calls']['total']} calls, {engine.get('streams_started', 0)} streams, "
        f"{engine.get('streams_cancelled', 0)} cancelled (barge-in or hang-up), {engine['active_streams']} still active"
    )
    print(f"recordings (left: caller, right: agent as heard): {out / 'calls'}/call-*.wav")
    print(f"report: {out / 'report.json'}; server log: {out / 'server.log'}")
    return 0 if all(c["error"] is None for c in report["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
