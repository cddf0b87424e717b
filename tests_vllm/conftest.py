"""Shared set-up of the real-vLLM tests: environment, the head-dim-32 test model, a process-group server runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import servers

# Before vLLM is imported anywhere: 1 GiB of KV cache (else vLLM sizes it from free memory), no usage reports.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm  # noqa: F401
except ImportError:  # not the vLLM venv (bash scripts/setup_vllm.sh makes it): nothing here can run
    collect_ignore_glob = ["test_*.py"]

SERVER_START_S = 180
ROOT = Path(__file__).resolve().parents[1]  # this checkout: the server imports the logits processor from it


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-test-model` output (head dim 32, the default) with the tiny SNAC: DIR/orpheus and DIR/snac."""
    from orpheus_tts_plugin.tools.testmodel import make_test_model

    out = tmp_path_factory.mktemp("test-model")
    make_test_model(out, snac="tiny")
    return out


@pytest.fixture(scope="session")
def vllm_config(test_model_dir: Path):
    """An engine on the vllm backend over the test model, on CPU (what the engine-level tests start)."""
    from orpheus_tts_plugin import EngineConfig

    # queue_timeout_s: no test here is about overload, and a 433-token cloned prompt's prefill on the CPU build, run
    # beside the oldest-versions tests at nice 19 (.ci/run), took longer than the default 2 s to its first token.
    return EngineConfig(
        backend="vllm",
        model=str(test_model_dir / "orpheus"),
        snac=str(test_model_dir / "snac"),
        device="cpu",
        queue_timeout_s=60.0,
    )


def invalid_positions(ids: list[int], first: int = 128_266, eos: int = 128_258) -> int:
    """Ids not valid at their output index k: first + (k % 7) * 4096 + [0, 4096), or eos when k % 7 == 0."""
    bad = 0
    for k, t in enumerate(ids):
        lo = first + (k % 7) * 4096
        bad += not (lo <= t < lo + 4096 or (t == eos and k % 7 == 0))
    return bad


def run_server(cmd: list[str], log_path: Path, url: str) -> Iterator[subprocess.Popen]:
    """`tests.servers.run_server` with this checkout importable (the server loads the logits processor from it)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1", "PYTHONPATH": path}
    with servers.run_server(cmd, log_path, url, start_s=SERVER_START_S, env=env) as proc:
        yield proc


PYTHON = sys.executable
