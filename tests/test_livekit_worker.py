"""A real AgentServer with the thread job executor and no LiveKit server: jobs share one engine; the example builds."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from livekit.agents import AgentServer, JobContext, JobProcess

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin import livekit as orpheus

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "livekit_agent.py"


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
