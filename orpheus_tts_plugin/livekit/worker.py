"""LiveKit Agents worker set-up for Orpheus: one engine per worker process, its load reported to LiveKit, and the
plugin entry that downloads the weights (livekit/tts.py re-exports all of it).

Every job of a worker that runs with the thread job executor (`JobExecutorType.THREAD`) lives in the worker
process, each on its own event loop in its own thread; `OrpheusEngine` serves all of them at once, so one GPU
engine speaks for every call. `server_options()` gives the `AgentServer` keyword arguments for that set-up
(thread executor, a `load_fnc` reporting the engine's load, a threshold), or, with `server_url`, for LiveKit's
default process-per-job executor, every job reaching `orpheus-tts serve` through `remote_engine(url)` (a
`RemoteEngine`: one connection per server per job process; `url` may list several servers, and each stream then
goes to the least-loaded one).
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..config import EngineConfig
from ..engine.core import OrpheusEngine
from ..errors import missing_extra
from ..types import SpeechEngine
from ..weights import download_files

try:
    from livekit.agents import AgentServer, JobExecutorType, Plugin
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("livekit", "the LiveKit adapter", exc) from exc

logger = logging.getLogger("orpheus_tts_plugin.livekit")
_used_configs: dict[EngineConfig, None] = {}  # configs this process builds engines from, for download_files()
_used_lock = threading.Lock()


def _engine_for(engine: SpeechEngine | EngineConfig | None) -> SpeechEngine:
    """The given engine (in process or a RemoteEngine), or the process-wide engine of a config (default if None)."""
    if engine is not None and not isinstance(engine, EngineConfig):
        config = engine.config
    else:
        config = engine or EngineConfig()
        engine = OrpheusEngine.shared(config)
    if isinstance(config, EngineConfig):  # a RemoteEngine's weights live on its server
        with _used_lock:
            _used_configs[config] = None
    return engine


# ---------------------------------------------------------------------------------------------- worker set-up
def prewarm_engine(engine: SpeechEngine | EngineConfig | None = None) -> SpeechEngine:
    """Start loading an engine (a config's process-wide engine, or connecting a RemoteEngine); returns at once.

    Call it from `setup_fnc`: loading a 3B model outlasts the worker's initialize timeout. A synthesis
    made before loading ends waits for it, up to `conn_options.timeout` per attempt. A failed load is
    logged by the engine and re-raised by every later synthesis.
    """
    engine = _engine_for(engine)
    engine.prewarm()
    return engine


def remote_engine(url: str | Sequence[str]) -> SpeechEngine:
    """This process's RemoteEngine for an `orpheus-tts serve` URL, or for several servers (a sequence or a
    comma-separated string: each stream goes to the least-loaded); one connection per server, made at once."""
    from ..client.remote_engine import RemoteEngine

    engine = RemoteEngine.shared(url)
    engine.prewarm()
    return engine


def engine_load_fnc(
    engine: SpeechEngine | EngineConfig | None = None, *, max_jobs: int | None = None
) -> Callable[[AgentServer], float]:
    """A worker `load_fnc`: the engine's stream load (fraction of `max_streams` in use), in [0, 1].

    A call holds an engine stream only while it speaks, so give `max_jobs` (calls one worker can
    serve) to report `active jobs / max_jobs` when that is higher. A failed or closed engine serves
    nothing more, so the worker then reports itself full and LiveKit sends new calls elsewhere. For a
    RemoteEngine the load is the server's own (1.0 while it cannot be reached; with several servers their
    mean), so workers of the process executor report the shared engine servers' load.
    """
    engine = _engine_for(engine)
    if max_jobs is not None and max_jobs < 1:
        raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")

    def load(server: AgentServer) -> float:
        if engine.health()["status"] in ("failed", "closed"):
            return 1.0
        jobs = len(server.active_jobs) / max_jobs if max_jobs else 0.0
        return min(1.0, max(engine.load, jobs))

    return load


def server_options(
    engine: SpeechEngine | EngineConfig | None = None,
    *,
    server_url: str | Sequence[str] | None = None,
    load_threshold: float = 0.8,
    max_jobs: int | None = None,
) -> dict[str, Any]:
    """`AgentServer(**server_options(...), ...)` keyword arguments for one engine shared by all jobs.

    In-process (the default): the thread job executor, every job on this process's engine. With
    `server_url` (an `orpheus-tts serve` on this machine or another, or several: a sequence or "URL,URL"):
    LiveKit's default process executor, each job process reaching the servers through
    `remote_engine(server_url)`, and the load reported to LiveKit is the servers' (their mean).
    """
    if server_url is not None:
        if engine is not None:
            raise ValueError("pass either engine or server_url, not both")
        return {
            "job_executor_type": JobExecutorType.PROCESS,
            "load_fnc": engine_load_fnc(remote_engine(server_url), max_jobs=max_jobs),
            "load_threshold": load_threshold,
        }
    return {
        "job_executor_type": JobExecutorType.THREAD,
        "load_fnc": engine_load_fnc(engine, max_jobs=max_jobs),
        "load_threshold": load_threshold,
    }


# ---------------------------------------------------------------------------------------------- weights
class OrpheusPlugin(Plugin):
    """The LiveKit plugin entry: `download-files` fetches the weights of every engine config this process uses."""

    def __init__(self) -> None:
        try:
            version = importlib.metadata.version("orpheus-tts-plugin")
        except importlib.metadata.PackageNotFoundError:
            version = "0.0.0"
        super().__init__("orpheus_tts_plugin.livekit", version, "orpheus_tts_plugin", logger)

    def download_files(self) -> None:
        with _used_lock:
            configs = list(_used_configs)
        download_files(*configs)


# LiveKit only accepts registrations from the main thread; an import from a job thread skips it.
if threading.current_thread() is threading.main_thread():
    Plugin.register_plugin(OrpheusPlugin())
