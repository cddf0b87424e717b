"""The package's structure as its sources draw it: no import cycle, the runtime never imports the workshop."""

from __future__ import annotations

import ast
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
