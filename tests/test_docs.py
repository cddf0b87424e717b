"""Every code block in README.md and docs/ is checked as its marker says (tests/docs_blocks.py): the runnable ones
run on the test model, the rest compile, parse with the CLI's own parser, or match the code they describe. A doc
that drifts from the code fails here."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from orpheus_tts_plugin.tools.loopback import free_port
from tests.docs_blocks import DOCS, REPO, Block, block_spec, blocks, commands, hub_cache

BLOCKS = blocks()
EXTRAS = set(metadata.metadata("orpheus-tts-plugin").get_all("Provides-Extra"))  # pyproject.toml's, as installed
# What a `run` block's reader would do next, run after it in its namespace: the proof that it did what it says.
EPILOGUES = {
    "from livekit.agents import Agent, AgentServer, AgentSession, JobContext, JobProcess\n": (
        "voice = orpheus.TTS(config=ENGINE, voice='tara')\n"
        "await voice.engine.start()\n"
        "assert [ev async for ev in voice.synthesize('Hello there.')]\n"
    ),
    "from openai import OpenAI": "import av\nassert av.open('hello.mp3').streams.audio[0].sample_rate == 24000\n",
    "from orpheus_tts_plugin import EngineConfig, OrpheusEngine\n": "assert chunk.sample_rate == 24000\n",
    "from pipecat.frames.frames import EndFrame, TTSSpeakFrame": "assert engine.stats()['streams_started'] >= 1\n",
}


def _epilogue(block: Block) -> str:
    return next((code for start, code in EPILOGUES.items() if block.text.startswith(start)), "")


def _of(kind: str, *langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind and (not langs or b.lang in langs)]


def test_every_code_block_says_how_it_is_checked() -> None:
    unmarked = [b.id for b in BLOCKS if b.kind is None]
    assert unmarked == [], "mark each with <!-- doc-test: KIND --> (tests/docs_blocks.py lists the kinds)"
    assert len(_of("run")) >= 6  # the README's quickstarts at least


# --------------------------------------------------------------------------------------------------- check
def _check_python(block: Block) -> None:
    # `...` standing for the rest of a call's arguments ("the application's own") is dropped before compiling.
    text = re.sub(r"^\s*\.\.\.,\s*$", "", block.text, flags=re.M)
    text = re.sub(r",\s*\.\.\.\s*(?=\))", "", text)
    code = compile(text, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST)
    for node in code.body:  # what it imports exists
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                    f"{block.id}: {node.module} has no {alias.name}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


def _check_bash(block: Block) -> None:
    from orpheus_tts_plugin.cli import build_parser

    for command in commands(block.text):
        for module, name in re.findall(r"\b(orpheus_tts_plugin(?:\.\w+)+):(\w+)", command):
            spec = importlib.util.find_spec(module)  # read, not imported: it may need what is not installed here
            assert spec and spec.origin, f"{block.id}: no module {module}"
            tree = ast.parse(Path(spec.origin).read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
            assert name in defined, f"{block.id}: no {module}:{name}"
        words = [w for w in shlex.split(command) if w not in ("…", "...")]
        while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
            words.pop(0)
        if words and words[0] == "orpheus-tts":
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as exc:
                pytest.fail(f"{block.id}: `{command}` does not parse (exit {exc.code})")
        for extra in re.findall(r"(?:orpheus-tts-plugin|\.)\[([\w,-]+)\]", command):  # from the index or a clone
            assert set(extra.split(",")) <= EXTRAS, f"{block.id}: no extra {extra!r} in pyproject.toml"
        for i, word in enumerate(words[:-1]):
            if word == "-m" and words[i + 1].split(".")[0] in ("orpheus_tts_plugin", "examples", "tests"):
                assert importlib.util.find_spec(words[i + 1]), f"{block.id}: no module {words[i + 1]}"
        if words[:3] == ["serve", "run", "orpheus_tts_plugin.server.ray:app"]:  # Ray Serve's CLI: key=value args
            from orpheus_tts_plugin.server.ray import parse

            parse(dict(word.split("=", 1) for word in words[3:] if "=" in word))
        for path in re.findall(r"\b((?:scripts|docker|examples|deploy)/[\w./-]+)", command):
            assert (REPO / path).exists(), f"{block.id}: no {path}"


@pytest.mark.parametrize("block", _of("check") + _of("run") + _of("server"), ids=lambda b: b.id)
def test_a_block_compiles_and_what_it_names_exists(block: Block) -> None:
    if block.lang == "python":
        _check_python(block)
    elif block.lang in ("bash", "sh"):
        _check_bash(block)
    else:
        assert block.lang in ("", "text", "json", "yaml"), f"{block.id}: no check for {block.lang!r} blocks"


@pytest.mark.parametrize("block", _of("covered by"), ids=lambda b: b.id)
def test_a_block_covered_elsewhere_names_what_covers_it(block: Block) -> None:
    paths = [p for p in re.split(r"\s+and\s+|,\s*", block.note) if p]
    assert paths
    for p in paths:
        file, _, test = p.partition("::")
        assert (REPO / file).exists(), f"{block.id}: no {file}"
        assert not test or f"def {test}(" in (REPO / file).read_text(), f"{block.id}: no {p}"
    _check_bash(block)


@pytest.mark.parametrize("block", _of("signature of"), ids=lambda b: b.id)
def test_a_documented_signature_is_the_codes(block: Block) -> None:
    module_name, _, name = block.note.split()[0].rpartition(".")
    module = importlib.import_module(module_name)
    actual = inspect.signature(getattr(module, name))
    text = re.sub(r"#.*", "", block.text).strip()
    assert text.startswith(f"{name}(") and text.endswith(")"), block.id
    documented = ast.parse(f"def f({text[len(name) + 1 : -1]}): pass").body[0].args
    positional = [a.arg for a in documented.args]
    keyword = [a.arg for a in documented.kwonlyargs]
    params = list(actual.parameters.values())
    assert positional == [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD], block.id
    assert keyword == [p.name for p in params if p.kind == p.KEYWORD_ONLY], block.id
    for arg, default in zip(documented.kwonlyargs, documented.kw_defaults, strict=True):
        want = actual.parameters[arg.arg].default
        assert (default is None) == (want is inspect.Parameter.empty), f"{block.id}: {arg.arg}"
        if default is not None:
            try:
                value = ast.literal_eval(default)
            except ValueError:  # a name, e.g. ENGLISH: the object of that name where the code defines it
                value = getattr(sys.modules[getattr(module, name).__module__], ast.unparse(default))
            assert value == want, f"{block.id}: {arg.arg}={ast.unparse(default)}, the code's default is {want!r}"


# ----------------------------------------------------------------------------------------------------- run
@pytest.fixture(scope="module")
def run_results(test_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every `run` and `server` block, in document order, run once in one fresh process (tests/docs_blocks.py)."""
    work = tmp_path_factory.mktemp("doc-blocks")
    spec = {
        "work": str(work),
        "port": str(free_port()),
        "blocks": [block_spec(b, _epilogue(b)) for b in BLOCKS if b.kind in ("run", "server")],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub_cache(work / "hub", test_model_dir)),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "NO_PROXY": "127.0.0.1",
        "PYTHONPATH": str(REPO),
    }
    cmd = [sys.executable, "-m", "tests.docs_blocks", str(work / "spec.json"), str(work / "results.json")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert (work / "results.json").exists(), done.stderr[-3000:]
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind in ("run", "server")], ids=lambda b: b.id)
def test_a_runnable_block_runs_on_the_test_model(block: Block, run_results: dict[str, dict]) -> None:
    assert block.id in run_results
    assert run_results[block.id]["error"] is None, run_results[block.id]["error"]


# --------------------------------------------------------------------------------------------------- links
def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", [p.relative_to(REPO) for p in DOCS], ids=str)
def test_every_relative_link_of_a_doc_reaches_a_file_and_heading_that_exist(doc: Path) -> None:
    source = REPO / doc
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        assert path.exists(), f"{doc}: no {file}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc}: no heading #{anchor} in {path.relative_to(REPO)}"
