"""Ctrl-C (SIGINT) in `orpheus-tts say` and `serve`, while the model loads and after: one line, status 130, at once.

A load that never ends is a model whose tokenizer_config.json is a FIFO (tests/model_dirs.py): the test then
never depends on how fast the host loads. Each test waits for the event it interrupts (a line on stderr, /health).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import wave
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineError, RemoteEngine
from orpheus_tts_plugin.tools.loopback import free_port
from tests.model_dirs import model_with
from tests.servers import default_sigint, serve_args, serve_process

EXIT_S = 15.0  # "promptly": a few seconds, with slack for a loaded host
LONG_TEXT = " ".join(f"Sentence number {i} is here, and it goes on for a while." for i in range(40))


@contextmanager
def cli(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """`orpheus-tts ARGS` with stderr (and stdout) to `log`; killed at the end if still running."""
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "orpheus_tts_plugin.cli", *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, preexec_fn=default_sigint)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    """Return once `cond()` holds; fail if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"exited with {proc.returncode} first:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"not reached in {timeout} s:\n{log.read_text()}"
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen, log: Path) -> str:
    """SIGINT `proc`; assert it exits with 130 within EXIT_S, its last line saying so and no traceback; that line."""
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    status = proc.wait(EXIT_S + 30)
    took = time.monotonic() - sent
    text = log.read_text()
    assert status == 130 and took < EXIT_S and "Traceback" not in text, f"{status} after {took:.1f} s:\n{text}"
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.fixture
def endless_load(tmp_path: Path, test_model_dir: Path) -> Path:
    """The test model, but its tokenizer never finishes loading."""
    return model_with(test_model_dir / "orpheus", tmp_path / "endless", "tokenizer_config.json", os.mkfifo)


def test_ctrl_c_while_say_loads_exits_at_once_with_one_line_and_status_130(
    tmp_path: Path, test_model_dir: Path, endless_load: Path
) -> None:
    log, out = tmp_path / "say.log", tmp_path / "a.wav"
    args = ["say", "Hello.", "--model", str(endless_load), "--snac", str(test_model_dir / "snac"), "--out", str(out)]
    with cli(args, log) as proc:
        wait_for(lambda: "orpheus-tts say: loading" in log.read_text(), proc, log)
        assert interrupt(proc, log) == "orpheus-tts say: interrupted"
    assert not out.exists()


def test_ctrl_c_while_say_speaks_writes_what_was_spoken_and_exits_130(tmp_path: Path, test_model_dir: Path) -> None:
    log, out = tmp_path / "say.log", tmp_path / "a.wav"
    model, snac = str(test_model_dir / "orpheus"), str(test_model_dir / "snac")
    with cli(["say", LONG_TEXT, "--model", model, "--snac", snac, "--device", "cpu", "--out", str(out)], log) as proc:
        wait_for(lambda: "orpheus-tts say: speaking" in log.read_text(), proc, log)
        time.sleep(2.0)  # some audio first, most likely (either way the line below holds)
        line = interrupt(proc, log)
    if line == "orpheus-tts say: interrupted":  # interrupted before its first audio
        assert not out.exists()
        return
    assert line.startswith("orpheus-tts say: interrupted; wrote the ") and line.endswith(f" s spoken so far to {out}")
    with wave.open(str(out)) as w:
        seconds = w.getnframes() / w.getframerate()
    assert seconds > 0 and f"wrote the {seconds:.2f} s" in line


def _health(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return json.load(resp)["status"]
    except OSError:
        return None


def test_ctrl_c_while_serve_loads_exits_at_once_with_one_line_and_status_130(
    tmp_path: Path, test_model_dir: Path, endless_load: Path
) -> None:
    log, port = tmp_path / "serve.log", free_port()
    args = ["serve", "--model", str(endless_load), "--snac", str(test_model_dir / "snac"), "--device", "cpu"]
    with cli([*args, "--port", str(port)], log) as proc:
        wait_for(lambda: _health(port) == "starting", proc, log)
        assert interrupt(proc, log) == "orpheus-tts serve: interrupted"


@pytest.mark.parametrize(("pace", "max_tokens"), [(0.0, 200_000), (400.0, 40_000)], ids=["fast", "paced"])
async def test_ctrl_c_while_serve_streams_ends_the_stream_and_exits_130(
    test_model_dir: Path, tmp_path: Path, pace: float, max_tokens: int
) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    remote = RemoteEngine(f"ws://127.0.0.1:{port}", connect_timeout_s=0.5, backoff_s=(0.05, 0.5))
    try:
        with serve_process(serve_args(test_model_dir / "snac", port, pace), log) as proc:
            chunks = remote.synthesize("Hello there.", seed=1, max_tokens=max_tokens)
            await asyncio.wait_for(chunks.__anext__(), 30)
            line = await asyncio.to_thread(interrupt, proc, log)
            with pytest.raises(EngineError):
                async for _ in chunks:
                    pass
        assert line == "orpheus-tts serve: interrupted"
    finally:
        await remote.aclose()
