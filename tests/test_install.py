"""The README's install from a clone, as a new user meets it: the wheel built from this checkout, installed with
one extra into a clean venv (no system site-packages, not this test's venv), then `orpheus-tts --version` and
`orpheus-tts say` on the test model.

pip resolves and installs every dependency of the package and its extra from the index, except torch: the README
has a user install torch first, for their driver, and so does this test, by linking the test venv's own CPU torch
into the clean venv (torch's own dependencies pip still installs). Installing torch again would add its 750 MB
unpack to every CI run: 2 min 22 s alone on the AMD EPYC host (2 CPUs, busy), where this whole module took 4 min 35 s
(58 s of CPU).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import wave
from importlib import metadata
from pathlib import Path

import pytest

import orpheus_tts_plugin

REPO = Path(__file__).resolve().parents[1]
EXTRA = "remote"  # the lightest extra (aiohttp): what is tested is the install, not the extra's use


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`cmd` with this checkout off the path (no PYTHONPATH): what runs is what the venv installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: {done.stderr[-3000:]}"
    return done


def _wheel(out: Path) -> Path:
    """The wheel of a copy of the package's sources (a build in the checkout would leave build/ behind in it).

    Built with this venv's setuptools (no build isolation: nothing fetched for the build itself)."""
    src = out / "checkout"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "orpheus_tts_plugin", src / "orpheus_tts_plugin", ignore=shutil.ignore_patterns("__pycache__")
    )
    pip = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out / "dist", src)
    _run(*pip, cwd=out)
    (wheel,) = (out / "dist").glob("orpheus_tts_plugin-*.whl")
    return wheel


def _link_torch(venv: Path) -> None:
    """This venv's torch, visible to the clean venv as if installed there first (a .pth naming a folder of links)."""
    torch = metadata.distribution("torch")
    site = Path(torch.locate_file(""))
    provided = venv / "provided"
    provided.mkdir()
    names = [*torch.read_text("top_level.txt").split(), f"torch-{torch.version}.dist-info"]
    for name in names:
        (provided / name).symlink_to(site / name)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "provided-torch.pth").write_text(f"{provided}\n")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with the wheel of this checkout and its [remote] extra installed."""
    work = tmp_path_factory.mktemp("install")
    wheel = _wheel(work)
    venv = work / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=work)
    _link_torch(venv)
    # --no-compile: its two commands compile what they import rather than pip every module (68 → 45 s here).
    _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[{EXTRA}]", cwd=work)
    return venv


def test_the_installed_wheel_is_this_checkouts_and_its_version_is_the_packages(venv: Path) -> None:
    where = _run(venv / "bin" / "python", "-c", "import orpheus_tts_plugin as p; print(p.__file__)", cwd=venv)
    assert Path(where.stdout.strip()).is_relative_to(venv)
    installed = _run(venv / "bin" / "python", "-m", "pip", "list", "--format=freeze", cwd=venv).stdout
    assert "aiohttp==" in installed and "transformers==" in installed and "snac==" in installed
    version = _run(venv / "bin" / "orpheus-tts", "--version", cwd=venv)
    assert version.stdout.strip() == f"orpheus-tts {orpheus_tts_plugin.__version__}"


def test_the_installed_command_speaks_on_the_test_model(venv: Path, test_model_dir: Path) -> None:
    out = venv.parent / "hello.wav"
    say = ("say", "Hello there.", "--model", test_model_dir / "orpheus", "--snac", test_model_dir / "snac")
    _run(venv / "bin" / "orpheus-tts", *say, "--device", "cpu", "--seed", "1", "--out", out, cwd=venv.parent)
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24_000 and wav.getnchannels() == 1 and wav.getnframes() > 0
