#!/usr/bin/env python
"""`orpheus-tts serve` against careless and hostile clients, as figures (tests/server/test_policy.py and
tests/client/test_upstream.py assert the same behaviours without timing).

    python scripts/hostile_checks.py --snac DIR/snac [--parts inputs,health,stall,failover] [--json out.json]

Real `orpheus-tts serve` processes on 127.0.0.1 (synthetic backend, the given SNAC, one API key, default limits):
  inputs    each hostile input once: the answer, and ms from the request (HTTP) or the connect (WebSocket) to it;
  health    GET /health latency (p50, p99, max) while a 4,096-character request arrives every 100 ms (each
            read for its first audio bytes, then closed);
  stall     the server's RSS while WebSocket clients that read nothing hold a stream each (1, 4), 0 to 60 s;
  failover  three servers, a RemoteEngine on all three, 6 endless streams, one server SIGKILLed: when its streams
            have all errored, and the first audio of a new stream on a survivor.
About 4 minutes with every part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from orpheus_tts_plugin import EngineError, RemoteEngine
from orpheus_tts_plugin.tools.bench.common import print_rows, run_metadata, write_json
from orpheus_tts_plugin.tools.loopback import free_port, http_status

KEY = "k-" + "h" * 30
TEXT = "Hello there. How are you today?"
PARTS = ("inputs", "health", "stall", "failover")


@contextlib.contextmanager
def serve(snac: str, *extra: str, token_rate: float = 200.0) -> Iterator[tuple[subprocess.Popen, int]]:
    """One `orpheus-tts serve` process with the key, ready (GET /ready 200); killed at the end."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "orpheus_tts_plugin.cli", "serve", "--backend", "synthetic", "--model", "",
        "--snac", snac, "--device", "cpu", "--port", str(port), "--token-rate", str(token_rate),
        "--api-key", KEY, *extra,
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while http_status(port, "/ready") != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not come up: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.1)
        yield proc, port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def http(
    port: int, path: str, body: bytes | None, key: str | None = KEY, method: str | None = None, whole: bool = False
) -> str:
    """The HTTP answer's status, having read the first bytes of its body (`whole`: all of it)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read() if whole else resp.read(64)
            return str(resp.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)


def speech(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": "orpheus", "input": text, **extra}).encode()


async def ws_answer(port: int, first: str | bytes | None, key: str | None = KEY, wait_s: float = 10.0) -> str:
    """What a WebSocket client gets after sending `first` (None: nothing): a close code or the first message type."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with connect(f"ws://127.0.0.1:{port}/v1/stream", additional_headers=headers, max_size=None) as ws:
            if first is not None:
                await ws.send(first)
            while True:
                raw = await asyncio.wait_for(ws.recv(), wait_s)
                if isinstance(raw, bytes):
                    return "audio"
                msg = json.loads(raw)
                if msg["type"] == "error":
                    await ws.send(json.dumps({"type": "stats", "req": 1}))  # still open?
                    return f"error {msg['error']}, connection open" if await _answers(ws) else "error, then closed"
                if msg["type"] not in ("hello", "status"):
                    return msg["type"]
    except ConnectionClosed as exc:
        return f"closed {exc.rcvd.code if exc.rcvd else 1006}"


async def _answers(ws: Any) -> bool:
    try:
        while json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] != "stats":
            pass
        return True
    except (ConnectionClosed, asyncio.TimeoutError):
        return False


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


def half_open(port: int, n: int, wait_s: float) -> str:
    """`n` sockets that send half a request line and nothing more: how many the server closed within `wait_s`."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.01)
        socks.append(s)
    closed, deadline = set(), time.monotonic() + wait_s
    while len(closed) < n and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(1024) == b"":
                    closed.add(i)
            except TimeoutError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.05)
    for s in socks:
        s.close()
    return f"{len(closed)} of {n} closed"


def part_inputs(snac: str) -> list[dict[str, Any]]:
    """Each hostile input once, against one server with the default limits."""
    rows: list[dict[str, Any]] = []
    with serve(snac) as (_, port):

        def row(name: str, fn: Callable[[], Any]) -> None:
            answer, ms = timed(fn)
            rows.append({"input": name, "answer": answer, "ms": round(ms, 1)})

        row("HTTP speech, no key", lambda: http(port, "/v1/audio/speech", speech(TEXT), key=None))
        row("HTTP speech, wrong key", lambda: http(port, "/v1/audio/speech", speech(TEXT), key="k-wrong"))
        row("HTTP body of 100,000 '['", lambda: http(port, "/v1/audio/speech", b"[" * 100_000))
        row("HTTP body of 30,000 '['", lambda: http(port, "/v1/audio/speech", b"[" * 30_000))
        deep = json.dumps({"model": "orpheus", "input": TEXT, "x": [[[[[[[[["x"]]]]]]]]]}).encode()
        row("HTTP JSON 9 levels deep", lambda: http(port, "/v1/audio/speech", deep))
        row("HTTP input of 4,097 characters", lambda: http(port, "/v1/audio/speech", speech("a" * 4097)))
        row("HTTP input of 1 MiB", lambda: http(port, "/v1/audio/speech", speech("a" * (1 << 20))))
        row("HTTP empty input", lambda: http(port, "/v1/audio/speech", speech("")))
        row("GET /v1/audio/speech", lambda: http(port, "/v1/audio/speech", None, method="GET"))
        row("GET /nowhere", lambda: http(port, "/nowhere", None))
        row("HTTP a good request (reference)", lambda: http(port, "/v1/audio/speech", speech(TEXT)))

        def ws(first: str | bytes | None, key: str | None = KEY) -> Callable[[], str]:
            return lambda: asyncio.run(ws_answer(port, first, key))

        start = {"type": "start", "id": 1, "text": TEXT}
        row("WS wrong key (header)", ws(json.dumps(start), key="k-wrong"))
        row("WS no key, no auth message", ws(None, key=None))
        row("WS 30,000 '['", ws("[" * 30_000))
        row("WS message of 70 KB", ws(json.dumps({**start, "text": "a " * 35_000})))
        row("WS start of 4,097 characters", ws(json.dumps({**start, "text": "a" * 4097})))
        row("WS a good start (reference)", ws(json.dumps(start)))
        row("200 half-open sockets", lambda: half_open(port, 200, 15.0))
    return rows


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args), its failure ignored (a flood request cut when its server stops)."""
    with contextlib.suppress(OSError):
        fn(*args)


def part_health(snac: str, seconds: float = 20.0) -> dict[str, Any]:
    """GET /health latency while a 4,096-character request arrives every 100 ms (each started, its first audio
    bytes read, then closed: text clean-up, splitting, tokenising and admission, again and again)."""
    with serve(snac) as (_, port):
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            body = speech(("Word " * 820)[:4096])
            while not stop.is_set():
                threading.Thread(target=quietly, args=(http, port, "/v1/audio/speech", body), daemon=True).start()
                sent[0] += 1
                stop.wait(0.1)

        threading.Thread(target=flood, daemon=True).start()
        lat, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            _, ms = timed(lambda: http_status(port, "/health"))
            lat.append(ms)
            time.sleep(0.02)
        stop.set()
    p = np.percentile(lat, [50, 99])
    return {"probes": len(lat), "requests": sent[0], "p50_ms": p[0], "p99_ms": p[1], "max_ms": max(lat)}


def metric(port: int, name: str) -> float:
    """A counter of the server's /metrics (`orpheus_{name}_total`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"orpheus_{name}_total "):
                return float(line.split()[1])
    return 0.0


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the server may fork), MB."""
    total = 0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def part_stall(snac: str, seconds: float = 60.0) -> dict[str, Any]:
    """Server RSS (beyond what one warm-up request leaves) and tokens generated while WebSocket clients with a
    4 KiB receive buffer each hold a stream and read nothing (1, then 4 on another server): generation pauses,
    memory stays flat."""

    async def stalled(port: int, i: int) -> Any:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ws = await connect(
            f"ws://127.0.0.1:{port}/v1/stream", sock=sock, additional_headers={"Authorization": f"Bearer {KEY}"},
            max_queue=1, ping_interval=None,
        )  # fmt: skip
        await ws.send(json.dumps({"type": "start", "id": 1, "text": f"Keep talking {i}. " * 200}))
        ws.transport.pause_reading()  # nothing more is read: the kernel's buffers fill, then the server's
        return ws

    async def run(proc: subprocess.Popen, port: int, clients: int) -> dict[str, Any]:
        await asyncio.to_thread(http, port, "/v1/audio/speech", speech(TEXT), whole=True)  # warm: first-call buffers
        base = rss_mb(proc.pid)
        sockets = [await stalled(port, i) for i in range(clients)]
        samples, t0 = {}, time.monotonic()
        for at in (0, 5, 15, 30, 45, seconds):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            samples[f"{at:g} s"] = {"rss_mb": round(rss_mb(proc.pid) - base, 1), "tokens": metric(port, "tokens")}
        for ws in sockets:
            await ws.close()
        return {"baseline_rss_mb": round(base, 1), "growth": samples, "slow_consumers": metric(port, "slow_consumers")}

    out = {}
    for clients in (1, 4):
        with serve(snac, token_rate=0.0) as (proc, port):
            out[f"{clients} stalled"] = asyncio.run(run(proc, port, clients))
    return out


def part_failover(snac: str) -> dict[str, Any]:
    """Three servers, 6 endless streams over a RemoteEngine, one server killed: errors and recovery, ms."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve(snac, "--budget-base", "1000000")) for _ in range(3)]
        urls = [f"ws://127.0.0.1:{port}" for _, port in servers]

        async def run() -> dict[str, Any]:
            remote = RemoteEngine(urls, api_key=KEY, connect_timeout_s=0.5, backoff_s=(0.05, 0.5))
            await remote.start(every_server=True)
            errors: list[float] = []

            async def hold(i: int) -> None:
                stream = remote.synthesize("Keep talking. " * 250, seed=i)
                try:
                    async for _ in stream:
                        pass
                except EngineError:
                    errors.append(time.monotonic())

            tasks = [asyncio.create_task(hold(i)) for i in range(6)]
            await asyncio.sleep(3.0)  # every stream speaking
            victim = max(urls, key=lambda u: remote.stats()["servers"][u]["active_streams"])
            held = remote.stats()["servers"][victim]["active_streams"]
            os.killpg(servers[urls.index(victim)][0].pid, signal.SIGKILL)
            killed = time.monotonic()
            while len(errors) < held and time.monotonic() < killed + 30:
                await asyncio.sleep(0.005)
            left_ms = (max(errors) - killed) * 1e3 if errors else None
            t = time.monotonic()
            first = remote.synthesize(TEXT, seed=99)
            await asyncio.wait_for(first.__anext__(), 30)
            retry_ms = (time.monotonic() - t) * 1e3
            await first.aclose()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await remote.aclose()
            return {
                "streams_on_victim": held,
                "errored": len(errors),
                "all_errored_ms_after_kill": left_ms,
                "new_stream_first_audio_ms": retry_ms,
            }

        return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--snac", required=True, help="a SNAC directory (orpheus-tts make-test-model --snac tiny)")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result: dict[str, Any] = {"bench": "hostile", "meta": run_metadata()}
    for name in args.parts.split(","):
        t = time.monotonic()
        print(f"{name} ...", flush=True)
        out = {"inputs": part_inputs, "health": part_health, "stall": part_stall, "failover": part_failover}[name](
            args.snac
        )
        result[name] = out
        if isinstance(out, list):
            print_rows(out, {"input": "input", "answer": "answer", "ms": "ms"})
        else:
            print(json.dumps(out, indent=1, default=float))
        print(f"({time.monotonic() - t:.0f} s)", flush=True)
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
