"""examples/livekit_agent.py through its real command line, as a subprocess, on the random-weight test model.

Offline, LiveKit allows a worker that registers with no server: `speak` runs the example's worker so and hands it
one simulated job, which speaks through the agent's own TTS. Every mistake is one line and exit status 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.server.serve import serving_in_thread

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "livekit_agent.py"
DEADLINE_S = 180.0  # a subprocess that outlives this has hung


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run(args: list[str], env: dict[str, str], *, module: bool = False) -> Run:
    """The example (or `python -m livekit.agents` on it) with `args`, in an environment of exactly `env`'s changes."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("LIVEKIT_", "ORPHEUS_"))}
    full.update(HF_HUB_OFFLINE="1", **env)
    command = [sys.executable, "-m", "livekit.agents", *args] if module else [sys.executable, str(EXAMPLE), *args]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=full, capture_output=True, text=True, timeout=DEADLINE_S)
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@pytest.fixture(scope="module")
def model_env(test_model_dir: Path) -> dict[str, str]:
    """The test model's paths, as a deployment would give its real ones."""
    return {
        "ORPHEUS_MODEL": str(test_model_dir / "orpheus"),
        "ORPHEUS_SNAC": str(test_model_dir / "snac"),
        "ORPHEUS_DEVICE": "cpu",
    }


def test_the_example_with_the_test_model_from_the_environment_speaks_through_a_simulated_job(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "hello.wav"
    done = run(["speak", "Hello there, how are you today?", "--out", str(out)], model_env)
    assert done.rc == 0, done.stderr
    assert done.stdout.startswith("spoke ") and "no LiveKit server" in done.stdout
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1 and wav.getnframes() > 0


def test_flags_override_the_environment_and_are_checked_before_anything_loads(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    done = run(["speak", "Hi.", "--out", str(tmp_path / "x.wav"), "--snac", model_env["ORPHEUS_MODEL"]], model_env)
    assert done.rc == 2 and len(done.error_lines) == 1
    assert "holds no SNAC checkpoint" in done.stderr and str(Path(model_env["ORPHEUS_SNAC"])) in done.stderr


@pytest.mark.parametrize("command", ["dev", "start"])
def test_dev_or_start_without_livekit_url_is_one_line_and_exit_status_2(
    model_env: dict[str, str], command: str
) -> None:
    done = run([command], model_env)
    assert done.rc == 2 and len(done.error_lines) == 1, done.stderr
    assert "LIVEKIT_URL" in done.stderr and "Traceback" not in done.stderr
    assert done.seconds < 30


def test_download_files_offline_is_one_line_naming_local_paths(tmp_path: Path) -> None:
    done = run(["download-files"], {"HF_HOME": str(tmp_path / "empty-cache")})  # the default hub ids, not cached
    assert done.rc == 2 and len(done.error_lines) == 1, done.stderr
    assert "hub cannot be reached" in done.stderr and "local directory" in done.stderr


def test_download_files_with_local_paths_has_nothing_to_fetch(model_env: dict[str, str]) -> None:
    done = run(["download-files"], model_env)
    assert done.rc == 0 and done.stdout.startswith("nothing to fetch"), done.stderr


def test_a_wrong_orpheus_snac_path_is_one_line_before_loading(model_env: dict[str, str], tmp_path: Path) -> None:
    wrong = {**model_env, "ORPHEUS_SNAC": str(tmp_path / "no-snac-here")}
    done = run(["speak", "Hi.", "--out", str(tmp_path / "x.wav")], wrong)
    assert done.rc == 2 and done.error_lines == [
        f"livekit_agent.py speak: error: cannot load SNAC: no such directory {str(tmp_path / 'no-snac-here')!r}"
    ]
    assert not (tmp_path / "x.wav").exists() and done.seconds < 30  # nothing loaded: no progress bar, no WAV


def test_livekit_cli_on_the_example_file_checks_the_settings_at_import(
    model_env: dict[str, str], tmp_path: Path
) -> None:
    wrong = {**model_env, "ORPHEUS_SNAC": str(tmp_path / "no-snac-here"), "LIVEKIT_URL": "ws://127.0.0.1:9"}
    done = run(["start", str(EXAMPLE)], wrong, module=True)  # what `lk agent start` runs
    assert done.rc == 2 and len(done.error_lines) == 1, done.stderr
    assert "no such directory" in done.stderr


def test_with_orpheus_server_url_the_simulated_job_speaks_in_a_job_process_through_the_engine_server(
    synthetic_config: EngineConfig, tmp_path: Path
) -> None:
    out = tmp_path / "remote.wav"
    with serving_in_thread(OrpheusEngine(synthetic_config)) as server:
        done = run(["speak", "Hello from a job process.", "--out", str(out)], {"ORPHEUS_SERVER_URL": server.url})
        spoken = server.service.engine.stats().get("streams_completed", 0)
    assert done.rc == 0, done.stderr
    assert spoken == 1  # the job spoke through the engine server, not a model of its own
    with wave.open(str(out)) as wav:
        assert wav.getnframes() > 0


def test_start_and_dev_hand_the_agent_file_to_livekits_own_command_line(
    model_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's front door execs `python -m livekit.agents` (LiveKit's only public entry to its worker CLI):
    the flags it passes must be among those LiveKit's `start` takes, or this fails on an upstream change."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import livekit_cli

    for name, value in {**model_env, "LIVEKIT_URL": "ws://127.0.0.1:9", "LIVEKIT_API_KEY": "k"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LIVEKIT_API_SECRET", "s")
    execs: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        execs.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(livekit_cli.os, "execv", execv)
    for command in ("start", "dev"):
        with pytest.raises(SystemExit):
            livekit_cli.main(str(EXAMPLE), [command])
    assert [argv[:5] for argv in execs] == [[sys.executable, "-m", "livekit.agents", "start", str(EXAMPLE)]] * 2
    usage = subprocess.run(
        [sys.executable, "-m", "livekit.agents", "start", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    flags = {word for argv in execs for word in argv[5:] if word.startswith("--")}
    assert flags == {"--dev", "--log-format", "--log-level"} and all(flag in usage for flag in flags), usage
