"""The OpenAI route's costs, for docs/serving.md: time to first byte per `response_format` (and per `speed`) at one
stream, the encoders' and the stretch's CPU per audio second, and their cost per chunk (what a call would hold a loop).

    .venv/bin/python scripts/speech_formats_bench.py [--requests 40] [--model-dir DIR]

Serves the synthetic backend on the tiny SNAC (random weights: the test model) from a thread, unpaced, and asks
with one HTTP connection at a time; TTFB is request sent → first body byte at the client.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.server.encoders import FORMATS, Encoder
from orpheus_tts_plugin.server.serve import serving_in_thread
from orpheus_tts_plugin.speech.stretch import Stretch
from orpheus_tts_plugin.tools.bench.common import host_line, print_rows

TEXT = "Hello there. How are you today?"


def ttfb(port: int, body: dict[str, Any]) -> tuple[float, int]:
    """(seconds to the first body byte, body bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    sent = time.perf_counter()
    conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = response.read1(65536)
    at = time.perf_counter() - sent
    size = len(first) + len(response.read())
    assert response.status == 200, (response.status, first)
    conn.close()
    return at, size


def ttfb_rows(port: int, requests: int) -> list[dict[str, Any]]:
    cases = (
        [{"response_format": f} for f in FORMATS]
        + [{"response_format": "pcm", "speed": s} for s in (0.5, 1.5, 2.0, 4.0)]
        + [{"response_format": "mp3", "stream_format": "sse"}]
    )
    bodies = [{"model": "orpheus", "input": TEXT, "voice": "tara", "seed": 1, **case} for case in cases]
    for body in bodies:
        for _ in range(3):
            ttfb(port, body)  # warm-up: first encoder opens, first connections
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(requests):  # round robin: a busy moment of the host falls on every case alike
        for i, body in enumerate(bodies):
            times[i].append(ttfb(port, body)[0])
    return [
        {
            "case": ", ".join(f"{k}={v}" for k, v in case.items()),
            "p50_ms": round(1e3 * float(np.median(t)), 1),
            "p90_ms": round(1e3 * float(np.percentile(t, 90)), 1),
            "n": requests,
        }
        for case, t in zip(cases, times, strict=True)
    ]


def speech_like(seconds: float, rate: int = 24_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    tone = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 20))
    return (6000 * tone * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))).astype("<i2")


def chunked(audio: np.ndarray) -> list[bytes]:
    """The engine's chunking: a first chunk of 3435 samples, then 2048 (a frame) each."""
    sizes = [3435] + [2048] * (audio.size // 2048)
    out, at = [], 0
    for size in sizes:
        if at < audio.size:
            out.append(audio[at : at + size].tobytes())
        at += size
    return out


def cpu_rows(seconds: float = 20.0) -> list[dict[str, Any]]:
    """CPU seconds per audio second and ms per chunk (p50, max) of each encoder and of the stretch at each speed."""
    audio = speech_like(seconds)
    chunks = chunked(audio)
    rows = []
    makers: list[tuple[str, Any]] = [(f"encode {name}", lambda n=name: Encoder(FORMATS[n])) for name in FORMATS]
    makers += [(f"stretch speed={s}", lambda s=s: Stretch(s)) for s in (0.5, 0.8, 1.25, 1.5, 2.0, 4.0)]
    for name, make in makers:
        worker = make()
        step = worker.encode if isinstance(worker, Encoder) else worker.push
        per_chunk = []
        cpu0 = time.process_time()
        for chunk in chunks:
            t0 = time.perf_counter()
            step(chunk)
            per_chunk.append(time.perf_counter() - t0)
        worker.finish() if isinstance(worker, Encoder) else worker.flush()
        cpu = time.process_time() - cpu0
        rows.append(
            {
                "what": name,
                "cpu_s_per_audio_s": round(cpu / seconds, 5),
                "chunk_p50_ms": round(1e3 * float(np.median(per_chunk)), 3),
                "chunk_max_ms": round(1e3 * max(per_chunk), 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--model-dir", default=None, help="a make-test-model folder (default: one made now)")
    args = parser.parse_args()
    print(host_line())
    print_rows(cpu_rows(), {"what": "what", "cpu_s_per_audio_s": "CPU s / audio s", "chunk_p50_ms": "chunk p50 ms",
                            "chunk_max_ms": "chunk max ms"})  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or tmp)
        if args.model_dir is None:
            subprocess.run(
                [sys.executable, "-m", "orpheus_tts_plugin.cli", "make-test-model", str(model_dir), "--snac", "tiny"],
                check=True,
                capture_output=True,
            )
        config = EngineConfig(model=None, backend="synthetic", snac=str(model_dir / "snac"), device="cpu")
        engine = OrpheusEngine(replace(config, synthetic=SyntheticConfig(tokens_per_second=0.0)))
        with serving_in_thread(engine) as srv:
            while not engine.ready:  # the server's start-up loads the engine
                if engine.health()["status"] not in ("starting", "not started"):
                    raise SystemExit(f"the engine did not load: {engine.health()}")
                time.sleep(0.01)
            port = int(srv.http_url.rsplit(":", 1)[1])
            print_rows(ttfb_rows(port, args.requests), {"case": "request", "p50_ms": "TTFB p50 ms",
                                                          "p90_ms": "p90 ms", "n": "requests"})  # fmt: skip


if __name__ == "__main__":
    main()
