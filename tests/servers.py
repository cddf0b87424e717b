"""Real servers for tests, on loopback: a server subprocess that is up once GET url/health is 200, `transformers
serve` with a local model, `orpheus-tts serve` subprocesses (up once GET /ready is 200), a TCP relay that plays a
slow, late or breaking network in front of a server, and polling for an event with a deadline.

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


class TcpRelay:
    """A TCP relay on 127.0.0.1 to the server at `target_port` on loopback, which plays the network in between.

    What the client sends goes to the server as it comes. What the server sends comes back `chunk` bytes a write
    (`chunk=1`: byte by byte, two turns of the event loop after each, so that a client in the same loop reads each
    byte apart from the next), the first of it `first_byte_delay_s` late; with `cut_before`, only the bytes before
    that byte string's first occurrence come back (the last len(cut_before) - 1 bytes wait until the next ones
    show they do not start it), and then the relay closes both connections: the client's response ends there, in
    the middle of whatever it was reading. Each connection is cut at its own first occurrence. The relay listens
    on `port` (a free one if not given) from `start()`, which may come late, to play a server that comes up late;
    `close()` stops it and closes the connections still open. Use `async with` or start() / close().
    """

    def __init__(
        self,
        target_port: int,
        *,
        port: int | None = None,
        chunk: int = 65536,
        first_byte_delay_s: float = 0.0,
        cut_before: bytes | None = None,
    ):
        if chunk < 1 or cut_before == b"":
            raise ValueError("chunk must be >= 1 and cut_before non-empty")
        self.target_port = target_port
        self.port = port if port is not None else free_port()
        self.chunk = chunk
        self.first_byte_delay_s = first_byte_delay_s
        self.cut_before = cut_before
        self.cuts = 0  # connections cut at `cut_before`
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()  # one a connection

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    async def __aenter__(self) -> TcpRelay:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # nothing listens there: the client sees its connection closed
            client_w.close()
            self._tasks.discard(task)
            return
        self._writers |= {client_w, server_w}
        up = asyncio.ensure_future(self._forward(client_r, server_w))
        try:
            await self._back(server_r, client_w)
        except ConnectionError:
            pass
        finally:
            up.cancel()
            for writer in (client_w, server_w):
                writer.close()
                self._writers.discard(writer)
            self._tasks.discard(task)

    @staticmethod
    async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The client's bytes to the server as they come; the client's close closes the server's connection."""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The server's bytes to the client, paced and cut as the class docstring says."""
        seen = bytearray()  # every byte the server sent on this connection
        sent = 0  # how many of them went to the client
        hold = len(self.cut_before) - 1 if self.cut_before else 0  # bytes that may be the start of `cut_before`
        while data := await reader.read(65536):
            if not seen and self.first_byte_delay_s:
                await asyncio.sleep(self.first_byte_delay_s)
            seen += data
            at = seen.find(self.cut_before) if self.cut_before else -1
            end = at if at != -1 else max(sent, len(seen) - hold)
            await self._send(writer, seen[sent:end])
            sent = end
            if at != -1:
                self.cuts += 1
                return
        await self._send(writer, seen[sent:])

    async def _send(self, writer: asyncio.StreamWriter, data: bytes | bytearray) -> None:
        for i in range(0, len(data), self.chunk):
            writer.write(bytes(data[i : i + self.chunk]))
            await writer.drain()
            if self.chunk < 65536:  # two turns of the loop (one did not do): the client reads the piece alone
                await asyncio.sleep(0)
                await asyncio.sleep(0)


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
