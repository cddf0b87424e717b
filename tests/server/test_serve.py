"""`orpheus-tts serve`: as a process of its own (killed mid-stream and brought back, the SIGTERM drain, `--cpus`,
keys), a drain past its deadline, and a missing server dependency.

Each test runs with generation faster than decoding (synthetic tokens flat out) and slower (paced).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, EngineError, EngineOverloadedError, OrpheusEngine, RemoteEngine
from orpheus_tts_plugin.cli import build_parser
from orpheus_tts_plugin.server.serve import engine_config
from orpheus_tts_plugin.tools.loopback import free_port
from tests.served import PACES, TEXT, endless, serving
from tests.servers import ready_status, serve_args, serve_process, until

HOLD_TOKENS = {"fast": 7000, "paced": 2000}  # a few seconds of one stream either way (decoding or generating)


@pytest.mark.parametrize("pace", list(PACES))
async def test_a_killed_server_fails_its_calls_within_a_second_and_clients_reconnect_when_it_is_back(
    test_model_dir: Path, tmp_path: Path, pace: str
) -> None:
    port = free_port()
    args = serve_args(test_model_dir / "snac", port, PACES[pace])
    remote = RemoteEngine(f"ws://127.0.0.1:{port}", connect_timeout_s=0.5, backoff_s=(0.05, 0.5))
    try:
        with serve_process(args, tmp_path / "serve.log") as proc:
            await remote.start()
            chunks = remote.synthesize(TEXT, seed=1, max_tokens=HOLD_TOKENS[pace])
            await asyncio.wait_for(chunks.__anext__(), 30)
            proc.kill()
            killed = time.monotonic()
            with pytest.raises(EngineError):
                async for _ in chunks:
                    pass
            assert time.monotonic() - killed < 1.0
            proc.wait(30)
        assert remote.health()["status"] == "starting" and remote.load == 1.0
        with pytest.raises(EngineError, match="cannot reach"):
            await remote.synthesize(TEXT).__anext__()
        with serve_process(args, tmp_path / "serve.log"):
            await until(lambda: remote.ready)
            chunks = [c async for c in remote.synthesize(TEXT, seed=2)]
            assert chunks and chunks[-1].final
        assert remote.stats()["connects"] == 2
    finally:
        await remote.aclose()


@pytest.mark.parametrize("pace", list(PACES))
async def test_sigterm_stops_admitting_lets_open_streams_finish_then_exits(
    test_model_dir: Path, tmp_path: Path, pace: str
) -> None:
    port = free_port()
    args = serve_args(test_model_dir / "snac", port, PACES[pace], "--drain-timeout", "120")
    remote = RemoteEngine(f"ws://127.0.0.1:{port}")
    try:
        with serve_process(args, tmp_path / "serve.log") as proc:
            chunks = remote.synthesize(TEXT, seed=3, max_tokens=HOLD_TOKENS[pace])
            heard = [await asyncio.wait_for(chunks.__anext__(), 30)]
            proc.send_signal(signal.SIGTERM)
            await until(lambda: ready_status(port) == 503)  # a load balancer takes it out now
            await until(lambda: not remote.ready)  # the server told its clients
            with pytest.raises(EngineOverloadedError, match="draining"):
                await remote.synthesize(TEXT).__anext__()
            heard += [chunk async for chunk in chunks]  # the open stream finishes whole
            assert heard[-1].final
            assert await asyncio.to_thread(proc.wait, 60) == 0
        config = engine_config(build_parser().parse_args(args))
        reference = OrpheusEngine(replace(config, synthetic=replace(config.synthetic, tokens_per_second=0.0)))
        try:
            expected = b"".join([c.pcm async for c in reference.synthesize(TEXT, seed=3, max_tokens=HOLD_TOKENS[pace])])
        finally:
            await reference.aclose()
        got, want = (
            np.frombuffer(pcm, dtype="<i2").astype(np.int32) for pcm in (b"".join(c.pcm for c in heard), expected)
        )
        assert got.size == want.size and np.abs(got - want).max() <= 2
    finally:
        await remote.aclose()


@pytest.mark.parametrize("pace", list(PACES))
async def test_serve_with_cpus_runs_every_thread_on_them_and_speaks(
    test_model_dir: Path, tmp_path: Path, pace: str
) -> None:
    cpu = max(os.sched_getaffinity(0))
    port = free_port()
    args = serve_args(test_model_dir / "snac", port, PACES[pace], "--cpus", str(cpu))
    remote = RemoteEngine(f"ws://127.0.0.1:{port}")
    try:
        with serve_process(args, tmp_path / "s.log") as p:
            chunks = [c async for c in remote.synthesize(TEXT, seed=5)]
            tasks = os.listdir(f"/proc/{p.pid}/task")
            assert len(tasks) > 3  # the engine's loop, stepping and decoder threads, uvicorn's
            assert {frozenset(os.sched_getaffinity(int(t))) for t in tasks} == {frozenset({cpu})}
        assert chunks and chunks[-1].final
        assert f"on CPUs {cpu}" in (tmp_path / "s.log").read_text()
    finally:
        await remote.aclose()


def test_serve_off_loopback_without_a_key_warns_in_one_line_and_with_one_does_not(
    test_model_dir: Path, tmp_path: Path
) -> None:
    for extra, warned in (((), True), (("--api-key", "k"), False)):
        port = free_port()
        args = [*serve_args(test_model_dir / "snac", port, PACES["fast"], *extra), "--host", "0.0.0.0"]
        log = tmp_path / f"serve-{warned}.log"
        with serve_process(args, log):
            pass
        warnings = [line for line in log.read_text().splitlines() if "warning: 0.0.0.0 is not a loopback" in line]
        assert len(warnings) == int(warned), log.read_text()


def test_serve_with_an_unreadable_key_file_fails_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "orpheus_tts_plugin.cli", "serve", "--backend", "synthetic", "--model", "",
         "--api-key-file", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"orpheus-tts serve: error: cannot read the API key file {tmp_path / 'missing'}: No such")


async def test_a_drain_past_its_deadline_ends_open_streams_with_an_engine_error(config: EngineConfig) -> None:
    with serving(endless(config), drain_timeout_s=0.3) as srv:
        remote = RemoteEngine(srv.url)
        chunks = remote.synthesize(TEXT, max_tokens=1_000_000)
        await chunks.__anext__()
        srv.server.begin_drain()
        with pytest.raises(EngineError) as ended:
            async for _ in chunks:
                pass
        assert type(ended.value) is EngineError  # not EngineClosedError: for a client, that server went away
        await until(lambda: srv.server.drained is False)
        await remote.aclose()


@pytest.mark.parametrize(
    ("module", "use"),
    [
        ("fastapi", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        ("uvicorn", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        ("prometheus_client", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        (
            "websockets",
            "import orpheus_tts_plugin as o\ntry:\n    o.RemoteEngine\nexcept ImportError as e:\n    print(e)",
        ),
    ],
)
def test_a_missing_server_dependency_is_one_line_naming_the_extra(module: str, use: str) -> None:
    import subprocess
    import sys

    code = f"import sys; sys.modules[{module!r}] = None\n{use}\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = (done.stdout + done.stderr).strip()
    assert out.count("\n") == 0 and "pip install 'orpheus-tts-plugin[server]'" in out, out
