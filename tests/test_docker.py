"""docker/ without Docker: the Dockerfiles' extras, copies and import checks hold (the agent's, and the Ray replicas'
for KubeRay: Dockerfile.ray), and the agent's entrypoint (docker/run.sh) starts the phone agent on the hf backend
with the test model and answers a simulated Twilio call.

No Docker engine runs on the machines this project is built on, and the TensorRT-LLM base image cannot be pulled
there: `docker build`, the FP8 quantise-then-serve path and the trtllm backend in the container are not run here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
RAY_DOCKERFILE = (REPO / "docker" / "Dockerfile.ray").read_text()
RUN_SH = REPO / "docker" / "run.sh"
PACKAGE = "orpheus-tts-plugin"
# What the TensorRT-LLM release image ships and the Dockerfile pins (its keep-constraints list), not pip's to bring,
# and accelerate, a requirement of tensorrt_llm (NVIDIA/TensorRT-LLM requirements.txt) that ModelOpt imports if
# present (its optional `plugins.accelerate`), as it is in the test venv.
IMAGE_SHIPS = {"tensorrt-llm", "tensorrt", "nvidia-modelopt", "torch", "transformers", "triton", "numpy", "accelerate"}
# The agent's process as the container starts it: the server and every stage it builds for a call.
AGENT_MODULES = [
    "examples.pipecat_phone_agent.server",
    "examples.pipecat_phone_agent.bot",
    "examples.pipecat_phone_agent.offline_stt",
    "examples.pipecat_phone_agent.offline_responder",
    "examples.pipecat_phone_agent.openai_llm",
    "orpheus_tts_plugin.backends.hf",
    "orpheus_tts_plugin.client.remote_engine",
]
# A Ray replica's process (deploy/kuberay/rayservice.yaml): the app, its router, the manifest's backend. Ray's image
# ships Ray, and Ray brings psutil and colorama in its own wheel (ray/thirdparty_files, on sys.path once ray is
# imported); the rest comes with the `ray` extra.
RAY_MODULES = [
    "orpheus_tts_plugin.server.ray",
    "orpheus_tts_plugin.server.ray_router",
    "orpheus_tts_plugin.backends.hf",
]
RAY_IMAGE_SHIPS = {"ray", "psutil", "colorama"}


def _joined(text: str) -> str:
    return text.replace("\\\n", " ")


def dockerfile_extras(dockerfile: str = DOCKERFILE) -> list[str]:
    """The extras of `pip install ".[a,b]"` in a Dockerfile."""
    (extras,) = re.findall(r'pip install [^\n]*"\.\[([^\]]+)\]"', _joined(dockerfile))
    return extras.split(",")


def dockerfile_imports(dockerfile: str = DOCKERFILE) -> list[str]:
    """The modules of a Dockerfile's build-time `python3 -c "import ..."` checks."""
    return [m.strip() for check in re.findall(r'python3 -c "import ([^"]+)"', dockerfile) for m in check.split(",")]


def copied_sources(dockerfile: str) -> list[str]:
    """The repository paths a Dockerfile COPYs."""
    return [p for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", dockerfile, flags=re.M) for p in source.split()]


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def closure(extras: list[str]) -> set[str]:
    """Every distribution `pip install ".[extras]"` brings (as installed here, markers evaluated), by name."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(PACKAGE, frozenset(extras))]
    while todo:
        dist, wanted = todo.pop()
        key = f"{_name(dist)}[{','.join(sorted(wanted))}]"
        if key in seen:
            continue
        seen.add(key)
        for line in metadata.requires(dist) or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *wanted]):
                try:
                    metadata.version(req.name)
                except metadata.PackageNotFoundError:
                    continue  # not installed here (an optional platform wheel): nothing to follow
                todo.append((req.name, frozenset(req.extras)))
    return {key.split("[")[0] for key in seen}


def test_the_dockerfile_installs_extras_that_exist_and_copies_files_that_exist() -> None:
    declared = set(metadata.metadata(PACKAGE).get_all("Provides-Extra"))  # pyproject.toml's, as installed
    extras = dockerfile_extras()
    assert "phone-agent" in extras  # the entrypoint's program: Pipecat, uvicorn, pocketsphinx
    assert set(extras) <= set(declared), set(extras) - set(declared)
    for path in copied_sources(DOCKERFILE):
        assert (REPO / path).exists(), f"COPY {path}: no such file"
    assert re.search(r"^COPY docker/run\.sh /usr/local/bin/orpheus-agent$", DOCKERFILE, flags=re.M)
    assert re.search(r'^ENTRYPOINT \["orpheus-agent"\]$', DOCKERFILE, flags=re.M)
    assert subprocess.run(["bash", "-n", str(RUN_SH)]).returncode == 0


def test_the_ray_image_installs_the_ray_extra_at_its_own_ray_and_copies_files_that_exist() -> None:
    declared = set(metadata.metadata(PACKAGE).get_all("Provides-Extra"))
    assert dockerfile_extras(RAY_DOCKERFILE) == ["ray"] and "ray" in declared
    assert re.search(r'pip install "ray\[serve\]==\$\{RAY_VERSION\}" "\.\[ray\]"', RAY_DOCKERFILE)
    assert re.search(r"^FROM rayproject/ray:\$\{RAY_VERSION\}-", RAY_DOCKERFILE, flags=re.M)
    for path in copied_sources(RAY_DOCKERFILE):
        assert (REPO / path).exists(), f"COPY {path}: no such file"
    assert subprocess.run(["bash", "-n", str(REPO / "docker" / "ray-drain.sh")]).returncode == 0


@pytest.mark.parametrize("image", ["agent", "ray"])
def test_every_module_the_container_imports_is_brought_by_its_extras_or_its_base_image(image: str) -> None:
    """The Dockerfile's import check passes here (TensorRT-LLM itself excepted, as at build time: no GPU), and every
    third-party distribution its process loads (the agent's, or a Ray replica's) comes from the Dockerfile's extras
    or the base image."""
    if image == "agent":
        modules = [*dockerfile_imports(), *AGENT_MODULES]
        assert "orpheus_tts_plugin.tools.quantize" in modules
        brought = closure(dockerfile_extras()) | IMAGE_SHIPS
    else:
        modules = [*dockerfile_imports(RAY_DOCKERFILE), *RAY_MODULES]
        brought = closure(dockerfile_extras(RAY_DOCKERFILE)) | RAY_IMAGE_SHIPS
    # What this venv has beyond the image (the dev extra's: Ray, the OpenAI clients, ...) is hidden from the probe as
    # the image lacks it: an optional import of it is skipped there as here, and a hard one fails the probe.
    here = {_name(dist.metadata["Name"]): tops(dist) for dist in installed()}
    kept = set().union(*(names for dist, names in here.items() if dist in brought))  # a namespace stays if shared
    absent = sorted(set().union(*(names for dist, names in here.items() if dist not in brought)) - kept)
    probe = (
        "import importlib, importlib.abc, importlib.util, json, sys\n"
        f"ABSENT = set({absent!r})\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not in the image)', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        # An availability check (transformers asks find_spec for accelerate) sees an absent module as missing.
        "found = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, package=None: (\n"
        "    None if name.split('.')[0] in ABSENT else found(name, package))\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({getattr(m, '__file__', None) or '' for m in list(sys.modules.values())})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    files = {os.path.realpath(f) for f in json.loads(done.stdout.splitlines()[-1]) if f}
    assert loaded_distributions(files) - brought == set(), "the image would lack these"


def installed() -> list[metadata.Distribution]:
    """The distributions installed in this venv's site-packages (not the ones a package vendors, such as
    setuptools's `_vendor`, which show up once setuptools is imported and put its folder on sys.path)."""
    sites = {os.path.realpath(p) for p in site.getsitepackages()}
    return [d for d in metadata.distributions() if os.path.realpath(d.locate_file("")) in sites]


def tops(dist: metadata.Distribution) -> set[str]:
    """The top-level modules a distribution installs, by its RECORD."""
    names = {f.parts[0].split(".")[0] for f in dist.files or () if f.suffix in (".py", ".so") and f.parts}
    return {n for n in names if n.isidentifier()}


def loaded_distributions(files: set[str]) -> set[str]:
    """The installed distributions that hold `files` (by each one's RECORD: a namespace package such as `google` or
    `opentelemetry` is shared by several, so the top-level name does not tell which)."""
    found = set()
    for dist in installed():
        if any(os.path.realpath(dist.locate_file(f)) in files for f in dist.files or () if f.suffix in (".py", ".so")):
            found.add(_name(dist.metadata["Name"]))
    return found


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt-get install espeak-ng)")
def test_the_entrypoint_starts_the_agent_on_the_hf_backend_and_it_answers_a_simulated_call(
    test_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.pipecat_phone_agent.caller import CallScript, place_call
    from examples.pipecat_phone_agent.demo import running
    from examples.pipecat_phone_agent.make_fixtures import make_fixtures
    from orpheus_tts_plugin.tools.loopback import free_port

    lines = make_fixtures(tmp_path / "fixtures")
    port = free_port()
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # python3: this venv's
    for name, value in {
        "ORPHEUS_BACKEND": "hf",  # serves the source checkpoint as is: no FP8 quantisation
        "ORPHEUS_SOURCE_MODEL": str(test_model_dir / "orpheus"),
        "ORPHEUS_SNAC": str(test_model_dir / "snac"),
        "ORPHEUS_DEVICE": "cpu",
        "ORPHEUS_HOST": "127.0.0.1",
        "ORPHEUS_PORT": str(port),
        "ORPHEUS_APP_DIR": str(REPO),
        "ORPHEUS_FP8_DIR": str(tmp_path / "never-written"),
    }.items():
        monkeypatch.setenv(name, value)
    # Extra arguments reach the agent: a starved STT on a shared host may take its time (as the demo's test).
    agent_args = shlex.split("--stt-workers 1 --max-tokens 300 --stt-p99 100 --turn-stop-timeout 120")
    script = CallScript(question=lines["question"], barge_in=lines["barge_in"], timeout_s=120.0)
    with running(["bash", str(RUN_SH), *agent_args], f"http://127.0.0.1:{port}/stats", tmp_path / "agent.log"):
        call = asyncio.run(place_call(f"ws://127.0.0.1:{port}/ws", script, tmp_path / "call.wav"))
    assert call["error"] is None, (call, (tmp_path / "agent.log").read_text()[-3000:])
    assert call["greeting_ms"] is not None
    assert [t["said"] for t in call["turns"]] == ["question", "barge_in"]
    assert all(t["speech_end_to_agent_audio_ms"] is not None for t in call["turns"])
    assert not (tmp_path / "never-written").exists()  # the hf backend is not quantised
