"""LiveKit's default process-per-job executor: every job process reaches one `orpheus-tts serve` engine, or a list.

A real AgentServer (no LiveKit server) with `server_options(server_url=...)`; its job processes run the
entrypoint below, each speaking through `remote_engine(url)`, and write what they heard to a file. Job
processes fork from LiveKit's forkserver, which keeps the environment of its start, so each job learns
the server's URL and its output folder from the room's metadata.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from livekit.agents import AgentServer, JobContext, JobExecutorType
from livekit.protocol import models

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread
from tests.stubs import SPEED_IDS, SPEEDS


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
