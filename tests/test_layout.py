"""The package's structure as its sources draw it: no import cycle, the runtime never imports the workshop, each
folder imports only what its `__init__` allows, and no module or class grows past the size a reader can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orpheus_tts_plugin"
NAME = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def import_graph() -> dict[str, set[str]]:
    """Edges module → package module for every import statement: top level, in functions and under TYPE_CHECKING."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_built_from_the_sources() -> None:
    graph = import_graph()
    assert f"{NAME}.engine.core" in graph[f"{NAME}.tools.say"]
    assert f"{NAME}.config" in graph[f"{NAME}.backends"]  # a relative import from a package __init__
    assert f"{NAME}.codec.decoder" in graph[f"{NAME}.engine.core"]  # an import inside a function counts
    assert f"{NAME}.codec.decoder" in graph[f"{NAME}.tools.bench.engine"]  # so does one under TYPE_CHECKING


def test_the_package_has_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_runtime_never_imports_the_workshop_and_config_imports_nothing_of_the_package() -> None:
    graph = import_graph()
    runtime = [m for m in graph if not m.startswith(f"{NAME}.tools") and m != f"{NAME}.cli"]
    assert {m: sorted(t for t in graph[m] if t.startswith(f"{NAME}.tools")) for m in runtime} == dict.fromkeys(
        runtime, []
    )
    assert graph[f"{NAME}.config"] == set()
    assert not any(t.startswith(f"{NAME}.engine") for t in graph[f"{NAME}.backends"])


def test_the_server_and_its_client_import_only_the_wire_of_each_other() -> None:
    graph = import_graph()

    def reaches(half: str, other: str) -> dict[str, list[str]]:
        inside = [m for m in graph if m == f"{NAME}.{half}" or m.startswith(f"{NAME}.{half}.")]
        return {m: sorted(t for t in graph[m] if t.startswith(f"{NAME}.{other}")) for m in inside}

    assert reaches("server", "client") == {m: [] for m in reaches("server", "client")}
    assert reaches("client", "server") == {m: [] for m in reaches("client", "server")}
    for half in ("server", "client"):
        assert reaches("wire", half) == {m: [] for m in reaches("wire", half)}
    assert f"{NAME}.wire.protocol" in graph[f"{NAME}.server.mux"]
    assert f"{NAME}.wire.protocol" in graph[f"{NAME}.client.connection"]


def test_the_package_uses_relative_imports_only() -> None:
    absolute = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and (node.module or "").startswith(NAME)
        or isinstance(node, ast.Import)
        and any(a.name.startswith(NAME) for a in node.names)
    ]
    assert absolute == []


def test_help_and_importing_the_package_load_no_torch() -> None:
    code = (
        "import sys, contextlib, io\n"
        "import orpheus_tts_plugin\n"
        "from orpheus_tts_plugin.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['bench', 'engine', '--help'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent, timeout=120)


# ---------------------------------------------------------------- the house keeps its rooms
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_ROOT_MODULES = 12
ROOT = "root"  # the modules at the top of the package, as a folder's `May import:` line names them


def _folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def folder_of(module: str) -> str:
    """The top-level folder a module lives in, or ROOT for the modules at the top (and the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ROOT


def allowed_imports(folder: str) -> set[str] | None:
    """What the folder's `__init__` docstring allows after `May import:` (folder names and `root`); None for `any`."""
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    match = re.search(r"^May import: ([^.]*)\.", doc, re.MULTILINE)
    assert match, f"{folder}/__init__.py: its docstring has no 'May import: a, b.' line"
    names = {name.strip() for name in match.group(1).split(",")}
    if names == {"any"}:
        return None
    unknown = names - {ROOT, *_folders()}
    assert not unknown, f"{folder}/__init__.py: 'May import' names no folder {sorted(unknown)}"
    return names


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Lines per package module, and per class (`module:Class`, from its `class` line to its last)."""
    modules: dict[str, int] = {}
    classes: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        rel = str(path.relative_to(PACKAGE.parent))
        modules[rel] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, classes


def test_no_module_is_over_500_lines_and_no_class_over_300() -> None:
    modules, classes = sizes()
    for name, counts in (("modules", modules), ("classes", classes)):
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
        print(f"largest {name}: " + ", ".join(f"{n} {lines}" for n, lines in top))
    assert {m: n for m, n in modules.items() if n > MAX_MODULE_LINES} == {}
    assert {c: n for c, n in classes.items() if n > MAX_CLASS_LINES} == {}


def test_a_dozen_modules_at_most_stay_at_the_top_of_the_package() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_ROOT_MODULES, top


def test_each_folder_imports_only_what_its_init_allows() -> None:
    graph = import_graph()
    wrong: dict[str, list[str]] = {}
    for folder in _folders():
        allowed = allowed_imports(folder)
        if allowed is None:
            continue
        for module in (m for m in graph if folder_of(m) == folder):
            bad = sorted(t for t in graph[module] if folder_of(t) not in {folder, *allowed})
            if bad:
                wrong[module] = bad
    assert wrong == {}


def test_a_folder_importing_what_its_init_does_not_allow_would_be_caught() -> None:
    assert allowed_imports("codec") == {ROOT}
    assert folder_of(f"{NAME}.engine.core") == "engine" and folder_of(f"{NAME}.config") == ROOT
    assert folder_of(f"{NAME}.engine") == "engine" and folder_of(NAME) == ROOT
    graph = import_graph()
    assert f"{NAME}.spec" in graph[f"{NAME}.codec.codes"]  # codec → root: allowed, and seen
    assert f"{NAME}.engine.core" in graph[f"{NAME}.server.service"]  # server → engine: seen, so checkable


# Every name the README, docs/ and examples import, or that deployments point at, from where they import it
# (`backends.vllm_logits:OrpheusAudioLogitsProcessor` needs vLLM: tests_vllm/ loads it from that path).
DOCUMENTED = [
    f"from {NAME} import AudioChunk, EngineClosedError, EngineConfig, EngineError, EngineFailedError",
    f"from {NAME} import EngineOverloadedError, KeyRefusedError, ModelLoadError, OrpheusEngine, RemoteEngine",
    f"from {NAME} import SamplingOverrides, SamplingParams, Speech, SpeechEngine, SpeechOptions, SyntheticConfig",
    f"from {NAME} import OrpheusTTSService, Usage, __version__",
    f"from {NAME} import livekit as orpheus; orpheus.TTS, orpheus.server_options, orpheus.prewarm_engine",
    "orpheus.remote_engine, orpheus.engine_load_fnc, orpheus.download_files, orpheus.OrpheusPlugin",
    f"from {NAME}.pipecat import OrpheusTTSService, OrpheusTTSSettings, SpeakAheadUserTurnStopStrategy",
    f"from {NAME}.pipecat import ReplyHoldFrame, ReplyReleaseFrame",
    f"from {NAME}.server.ray import app",
    f"from {NAME}.cli import main",
    f"from {NAME}.speech.words import Weights",
]


def test_every_documented_name_imports_from_where_the_docs_say() -> None:
    subprocess.run([sys.executable, "-c", "\n".join(DOCUMENTED)], check=True, cwd=PACKAGE.parent, timeout=300)
