"""LiveKit's AgentServer with no LiveKit server: the thread job executor (jobs share one engine; the example builds)
and the default process-per-job executor (every job process reaches one `orpheus-tts serve` engine, or a list).

Process jobs: a real AgentServer with `server_options(server_url=...)`; its job processes run `entrypoint`
below, each speaking through `remote_engine(url)`, and write what they heard to a file. Job processes fork from
LiveKit's forkserver, which keeps the environment of its start, so each job learns the server's URL and its
output folder from the room's metadata.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from livekit.agents import AgentServer, JobContext, JobExecutorType, JobProcess
from livekit.protocol import models

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread
from tests.stubs import SPEED_IDS, SPEEDS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "livekit_agent.py"


@dataclass(frozen=True)
class JobResult:
    thread: int
    loop: int
    engine: OrpheusEngine
    samples: int


async def _serve(server: AgentServer, jobs: int, results: dict[str, JobResult], done: threading.Event) -> None:
    """Run `server` unregistered (no LiveKit server), hand it `jobs` simulated jobs, wait for all of them."""
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    try:
        await asyncio.sleep(0.2)
        for i in range(jobs):
            await server.simulate_job(f"room-{i}", fake_job=True)
        assert await asyncio.to_thread(done.wait, 30), f"jobs finished: {len(results)} of {jobs}"
    finally:
        await server.aclose()
        await run


async def test_thread_executor_jobs_share_the_process_wide_engine(synthetic_config: EngineConfig) -> None:
    jobs = 3
    results: dict[str, JobResult] = {}
    done = threading.Event()
    lock = threading.Lock()
    prewarmed: list[OrpheusEngine] = []

    def setup(proc: JobProcess) -> None:
        prewarmed.append(orpheus.prewarm_engine(synthetic_config))

    async def entrypoint(ctx: JobContext) -> None:
        tts = orpheus.TTS(config=synthetic_config)
        audio = await tts.synthesize(f"Hello from {ctx.job.id}.").collect()
        result = JobResult(threading.get_ident(), id(asyncio.get_running_loop()), tts.engine, audio.samples_per_channel)
        with lock:
            results[ctx.job.id] = result
            if len(results) == jobs:
                done.set()
        ctx.shutdown()

    server = AgentServer(**orpheus.server_options(synthetic_config), setup_fnc=setup, port=0)
    server.rtc_session(entrypoint)
    shared = OrpheusEngine.shared(synthetic_config)
    owned = not shared.started  # close it afterwards unless another test started it
    completed = shared.stats().get("streams_completed", 0)
    try:
        await _serve(server, jobs, results, done)
        assert {r.engine for r in results.values()} == {shared} and set(prewarmed) == {shared}
        assert len({r.thread for r in results.values()}) == jobs  # each job: its own thread ...
        assert len({r.loop for r in results.values()}) == jobs  # ... and its own event loop
        assert all(r.samples > 0 for r in results.values())
        assert shared.stats()["streams_completed"] - completed == jobs
    finally:
        if owned:
            await shared.aclose()


def _import_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orpheus_livekit_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_example_builds_its_server_without_a_livekit_server(
    test_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # its helper modules, as a script run finds them
    monkeypatch.setenv("ORPHEUS_MODEL", str(test_model_dir / "orpheus"))  # checked at import: the test model's paths
    monkeypatch.setenv("ORPHEUS_SNAC", str(test_model_dir / "snac"))
    monkeypatch.setenv("ORPHEUS_DEVICE", "cpu")
    monkeypatch.delenv("ORPHEUS_SERVER_URL", raising=False)
    example = _import_example()
    server = example.server
    assert isinstance(server, AgentServer)
    assert server.setup_fnc is example.prewarm
    assert not OrpheusEngine.shared(example.SETTINGS.engine).started  # importing loads no model
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    await asyncio.sleep(0.2)
    assert not run.done()  # the worker is up with no LiveKit server to talk to
    assert server.load_fnc(server) == 0.0  # no calls, idle engine
    await server.aclose()
    await run


# ------------------------------------------------------------------ process-per-job executor
async def entrypoint(ctx: JobContext) -> None:
    """Runs in a job process: speak through this process's RemoteEngine and record the result."""
    where = json.loads(ctx.job.room.metadata)
    engine = orpheus.remote_engine(where["url"])
    audio = await orpheus.TTS(engine=engine, seed=1).synthesize(f"Hello from {ctx.job.id}.").collect()
    record = {"pid": os.getpid(), "samples": audio.samples_per_channel, "engine": type(engine).__name__}
    (Path(where["out"]) / f"{ctx.job.id}.json").write_text(json.dumps(record))
    ctx.shutdown()


@pytest.fixture(scope="module", params=list(SPEEDS.values()), ids=SPEED_IDS)
def served(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[ServerThread]:
    config = replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param))
    with serving_in_thread(OrpheusEngine(config)) as server:
        yield server


async def jobs_through(server_url: str, jobs: int, out: Path) -> list[dict[str, Any]]:
    """A worker built with `server_options(server_url=...)` runs `jobs` jobs, each in a process of its own that
    speaks once through `remote_engine(server_url)`: what each heard."""
    options = orpheus.server_options(server_url=server_url, max_jobs=8)
    assert options["job_executor_type"] == JobExecutorType.PROCESS
    server = AgentServer(**options, port=0, num_idle_processes=0)
    server.rtc_session(entrypoint)
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    try:
        deadline = time.monotonic() + 30
        while _load(server) > 0.0:  # 1.0 until this process's RemoteEngine has connected; then the servers idle
            assert time.monotonic() < deadline, "the worker never reached the engine servers"
            await asyncio.sleep(0.05)
        where = json.dumps({"url": server_url, "out": str(out)})
        for i in range(jobs):
            room = models.Room(sid=f"SRM_{i}", name=f"room-{i}", metadata=where)
            await server.simulate_job(room.name, fake_job=True, room_info=room)
        deadline = time.monotonic() + 120
        while len(list(out.glob("*.json"))) < jobs:
            assert time.monotonic() < deadline, "the job processes did not finish"
            await asyncio.sleep(0.1)
    finally:
        await server.aclose()
        await run
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert {r["engine"] for r in records} == {"RemoteEngine"} and all(r["samples"] > 0 for r in records)
    assert len({r["pid"] for r in records} | {os.getpid()}) == jobs + 1  # each job in a process of its own
    return records


async def test_process_jobs_speak_through_one_engine_server_and_report_its_load(
    served: ServerThread, tmp_path: Path
) -> None:
    before = served.service.engine.stats().get("streams_completed", 0)
    await jobs_through(served.url, 2, tmp_path)
    assert served.service.engine.stats()["streams_completed"] - before == 2  # all spoken by the one server


async def test_process_jobs_speak_through_a_list_of_engine_servers(served: ServerThread, tmp_path: Path) -> None:
    with serving_in_thread(OrpheusEngine(served.service.engine.config)) as other:
        engines = [served.service.engine, other.service.engine]
        before = [e.stats().get("streams_completed", 0) for e in engines]
        await jobs_through(f"{served.url},{other.url}", 2, tmp_path)  # as ORPHEUS_SERVER_URL=URL,URL would give it
        spoken = [e.stats().get("streams_completed", 0) - b for e, b in zip(engines, before)]
    assert sum(spoken) == 2  # every job reached the servers of the list (each process to the least loaded)


def _load(server: AgentServer) -> float:
    """The worker's reported load; 1.0 while the worker itself is still starting (no job pool yet)."""
    try:
        return server.load_fnc(server)
    except AttributeError:
        return 1.0


def test_server_url_and_an_engine_are_exclusive(synthetic_config: EngineConfig) -> None:
    with pytest.raises(ValueError, match="either engine or server_url"):
        orpheus.server_options(synthetic_config, server_url="ws://127.0.0.1:1")
