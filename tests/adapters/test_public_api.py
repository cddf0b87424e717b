"""The adapters use Pipecat and LiveKit through their public API only (issue 20, point 2).

The underscore names are listed from the installed frameworks: every attribute on the upstream classes an
adapter subclasses or uses (their MROs, by `dir()`), plus every `self._x` those classes' sources assign.
The adapter's sources are then read (ast) for any use of one: `obj._x`, `def _x` in a class, `_x: T` in
a class body. A name that is the adapter's own (in no upstream class) is allowed; so is an upstream
abstract method, which the framework requires a subclass to define (LiveKit's `_run`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "orpheus_tts_plugin"
UPSTREAM = ("pipecat", "livekit")

# Uses the public API has no workaround for: (framework, name) -> why. The test fails on any use not listed
# here, and on a listed one no longer used, so the list only shrinks.
KNOWN: dict[tuple[str, str], str] = {
    ("livekit", "_mark_started"): (
        "tts/tts.py SynthesizeStream: the only start of a stream's metrics clock (`_started_time`, left 0 no TTS"
        " metrics are emitted); LiveKit's own plugins call it"
    ),
}


def _adapter(name: str) -> ModuleType:
    return pytest.importorskip(f"orpheus_tts_plugin.{name}")


def _is_upstream(obj: object) -> bool:
    return inspect.isclass(obj) and obj.__module__.split(".")[0] in UPSTREAM


def _referenced_classes(module: ModuleType, tree: ast.AST) -> set[type]:
    """Upstream classes the module names: in its namespace, as `mod.Class`, and the bases of its own classes."""
    found = {obj for obj in vars(module).values() if _is_upstream(obj)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = vars(module).get(node.value.id)
            if isinstance(owner, ModuleType) and _is_upstream(getattr(owner, node.attr, None)):
                found.add(getattr(owner, node.attr))
    for obj in vars(module).values():
        if inspect.isclass(obj) and obj.__module__ == module.__name__:
            found.update(c for c in obj.__mro__ if _is_upstream(c))
    return {c for cls in found for c in cls.__mro__ if _is_upstream(c)}


def _assigned_names(cls: type) -> set[str]:
    """The `self._x` names a class's own source assigns or reads (instance attributes are not in `dir()`)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return set()
    return {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}


def _private(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}


def upstream_private_names(module: ModuleType, tree: ast.AST) -> set[str]:
    """Every underscore name defined by the upstream classes the module uses, less their abstract methods."""
    classes = _referenced_classes(module, tree)
    names = set().union(*(_private(set(dir(c)) | _assigned_names(c)) for c in classes))
    required = set().union(*(getattr(c, "__abstractmethods__", frozenset()) for c in classes))
    return names - required


def uses(tree: ast.AST, names: set[str]) -> dict[str, list[int]]:
    """Where the source reads, writes, defines or declares one of `names`: name -> line numbers."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = node.name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        if name in names:
            found.setdefault(name, []).append(node.lineno)
    return found


# Each framework's adapter and the modules it is split into (pipecat/health.py, livekit/worker.py, ...).
MODULES = {fw: sorted(f"{fw}.{p.stem}" for p in (PACKAGE / fw).glob("*.py") if p.stem != "__init__") for fw in UPSTREAM}


@pytest.mark.parametrize("framework", ["pipecat", "livekit"])
def test_the_adapter_touches_no_underscore_name_of_the_framework_beyond_the_known_list(framework: str):
    found: dict[str, list[int]] = {}
    for name in MODULES[framework]:
        module = _adapter(name)
        path = PACKAGE / f"{name.replace('.', '/')}.py"
        tree = ast.parse(path.read_text(), str(path))
        names = upstream_private_names(module, tree)
        assert len(names) > 20, f"{name}: found only {sorted(names)}: the upstream classes were not read"
        for used, lines in uses(tree, names).items():
            found.setdefault(used, []).extend(lines)
    assert len(MODULES[framework]) >= 2, MODULES  # the adapter's folder was found
    known = {name for fw, name in KNOWN if fw == framework}
    report = "\n".join(f"  {framework}:{','.join(map(str, lines))}: {name}" for name, lines in sorted(found.items()))
    print(f"{framework}: {len(found)} underscore name(s) of the framework used\n{report}")
    assert set(found) <= known, f"underscore names of {framework} used:\n{report}"
    assert known <= set(found), f"no longer used, drop from KNOWN: {sorted(known - set(found))}"


def test_the_pipecat_settings_are_a_dataclass_of_tts_settings_with_every_sampling_field():
    pipecat = _adapter("pipecat")
    from dataclasses import fields, is_dataclass

    from pipecat.services.settings import TTSSettings

    from orpheus_tts_plugin.config import SAMPLING_FIELDS

    settings = pipecat.OrpheusTTSSettings
    assert is_dataclass(settings) and issubclass(settings, TTSSettings)
    assert set(SAMPLING_FIELDS) <= {f.name for f in fields(settings)}
    tree = ast.parse(Path(inspect.getsourcefile(settings) or "").read_text())
    declared = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "OrpheusTTSSettings"]
    assert [ast.unparse(b) for b in declared[0].bases] == ["TTSSettings"]
    assert [ast.unparse(d) for d in declared[0].decorator_list] == ["dataclass"]


def test_the_fenced_pipecat_behaviours_the_service_relies_on_are_still_upstream():
    """Each Pipecat behaviour the service relies on without a public API (docs/frameworks.md), read from the installed
    TTSService: this fails on the upstream change that would break its one fenced function."""
    pytest.importorskip("orpheus_tts_plugin.pipecat.tts")
    from pipecat.services.tts_service import TTSService

    from orpheus_tts_plugin.pipecat.health import _SILENT_CONTEXT

    # pipecat_health.ServiceHealth.push_error: the per-context error of a silent context, by its text
    outcome = inspect.getsource(TTSService._record_context_audio_outcome)
    assert 'f"TTS context {context_id} completed with no audio"' in outcome
    assert _SILENT_CONTEXT.fullmatch("TTS context 1a-2b completed with no audio")["context_id"] == "1a-2b"
    # pipecat_health.ServiceHealth._restart_silence_count: set_usable(True) zeroes the count of silent contexts
    assert "self._consecutive_zero_audio_contexts = 0" in inspect.getsource(TTSService.set_usable)
    # pipecat.OrpheusTTSService._keep_context_open: create_context_id() refreshes the turn's audio context
    assert "self._refresh_audio_context(self._turn_context_id)" in inspect.getsource(TTSService.create_context_id)
