"""Real servers for tests, on loopback: a free port, and a server subprocess that is up once GET url/health is 200.

Shared by tests/ and tests_vllm/ (the vLLM venv), so it imports only the standard library and pytest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (a server and any processes it spawned), SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
