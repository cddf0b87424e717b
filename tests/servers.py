"""Real servers for tests, on loopback: a server subprocess that is up once GET url/health is 200, `transformers
serve` with a local model, `orpheus-tts serve` subprocesses (up once GET /ready is 200), and polling for an event
with a deadline.

Shared by tests/ and tests_vllm/ (the vLLM venv), so it imports only the standard library, pytest and the
package's loopback probes (orpheus_tts_plugin/tools/loopback.py; the tests take free_port from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orpheus_tts_plugin.tools.loopback import free_port, http_status

TRANSFORMERS_SERVE_START_S = 120  # loading the test model and its tokenizer on a busy 2-core host


@contextlib.contextmanager
def run_server(
    cmd: list[str], log_path: Path, url: str, *, start_s: float, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Start `cmd` in its own process group, wait for GET url/health, yield it; SIGTERM the group at the end."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{' '.join(cmd[:4])} ... did not come up:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield proc
    finally:
        _stop_group(proc)


@contextlib.contextmanager
def transformers_serve(model_dir: Path, log_path: Path) -> Iterator[str]:
    """`transformers serve` with the model in `model_dir` on CPU on a free loopback port, offline; its base URL
    (the OpenAI API under /v1, the model's id is `str(model_dir)`). Its log has a line per request with the
    generation settings."""
    pytest.importorskip("fastapi", reason="needs transformers[serving]")
    pytest.importorskip("uvicorn", reason="needs transformers[serving]")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1"}
    env.setdefault("OMP_NUM_THREADS", "1")  # the test model's ops are too small to split; idle threads spin
    cmd = [
        sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--enable-log-requests",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with run_server(cmd, log_path, url, start_s=TRANSFORMERS_SERVE_START_S, env=env):
        yield url


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (a server and any processes it spawned), SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def serve_args(snac: Path, port: int, token_rate: float, *extra: str) -> list[str]:
    """`orpheus-tts serve` flags: synthetic tokens at `token_rate` a stream (0: flat out), tiny SNAC, utterances
    as long as their max_tokens."""
    return [
        "serve", "--backend", "synthetic", "--model", "", "--snac", str(snac), "--device", "cpu",
        "--port", str(port), "--token-rate", str(token_rate), "--frames-per-token", "64",
        "--budget-base", "1000000", *extra,
    ]  # fmt: skip


def ready_status(port: int) -> int | None:
    """GET /ready's status, or None if nothing listens."""
    return http_status(port, "/ready")


@contextlib.contextmanager
def serve_processes(arg_lists: list[list[str]], log: Path) -> Iterator[list[subprocess.Popen]]:
    """`orpheus-tts serve ARGS` for each ARGS, all started at once, once each /ready answers 200; those still
    running at the end are killed."""
    procs: list[subprocess.Popen] = []
    try:
        with log.open("ab") as out:
            for args in arg_lists:
                cmd = [sys.executable, "-m", "orpheus_tts_plugin.cli", *args]
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=out, preexec_fn=default_sigint))
        deadline = time.monotonic() + 120
        for args, proc in zip(arg_lists, procs):
            while ready_status(int(args[args.index("--port") + 1])) != 200:
                assert proc.poll() is None, f"serve exited with {proc.returncode}: {log.read_text()}"
                assert time.monotonic() < deadline, "serve did not become ready"
                time.sleep(0.05)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait(30)


@contextlib.contextmanager
def serve_process(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """`orpheus-tts serve ARGS` in a subprocess, once /ready answers 200; killed at the end if still running."""
    with serve_processes([args], log) as (proc,):
        yield proc


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Return once `cond()` holds, polling every 10 ms; fail the test if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def default_sigint() -> None:
    """`preexec_fn` of a child that a test interrupts: SIGINT back to its default, whatever the test runner's
    parent did (a shell's background job inherits SIGINT ignored, and Ctrl-C would then not reach the child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
