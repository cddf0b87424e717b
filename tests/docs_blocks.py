"""The fenced code blocks of README.md and docs/*.md, each with the marker that says how tests/test_docs.py checks it.

A marker is an HTML comment on the line before the fence (a blank line between is allowed):
`<!-- doc-test: KIND -->` or `<!-- doc-test: KIND (why) -->`, KIND one of

- `run`: run as written on the test model (python: top-level `await` inside an event loop; bash: every
  `orpheus-tts` line through the CLI), with the substitutions of `substitute`;
- `server`: a bash block of one `orpheus-tts serve` line, started in the background for the `run` blocks after it
  in the same file, and stopped at the file's end;
- `check`: not run (it needs a GPU, real weights, a network or someone else's objects): python compiles and its
  imports resolve; in bash, `orpheus-tts` lines parse with the CLI's own parser, `pip install` extras exist in
  pyproject.toml, `python -m`/`scripts/` targets of this repository exist, and `module:attr` references resolve;
- `signature of MODULE.NAME`: the block is a call signature; it must match `inspect.signature(NAME)`;
- `covered by PATH [and PATH…]`: run elsewhere by CI (e.g. `.ci/run`, a test file); each path must exist;
- `text`: not code (a diagram, an error message, a usage synopsis, a record of a past run).

This module runs as a script too (`python -m tests.docs_blocks SPEC.json RESULTS.json`): it runs the `run` and
`server` blocks listed in SPEC in a fresh process whose Hugging Face cache holds the test model under the real hub
ids, offline, so the blocks' `canopylabs/orpheus-3b-0.1-ft` and `hubertsiuzdak/snac_24khz` load it as written.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = "run|server|check|signature of|covered by|text"
MARKER = re.compile(rf"^\s*<!-- doc-test: (?P<kind>{KINDS})\b\s*(?P<note>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
DOC_PORT = "8880"  # the port the docs' servers and clients use; a free one in the test


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: str | None  # None: unmarked
    note: str
    section: str  # the heading above it

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(paths: list[Path] = DOCS) -> list[Block]:
    """Every fenced block of `paths`, in order."""
    found: list[Block] = []
    for path in paths:
        lines = path.read_text().split("\n")
        section, i = "", 0
        while i < len(lines):
            if lines[i].startswith("#") and not lines[i].startswith("#!"):
                section = lines[i].lstrip("#").strip()
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            indent = len(fence["indent"])
            text = "\n".join(line[indent:] for line in lines[i + 1 : end])
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before)
            kind, note = (marker["kind"], marker["note"]) if marker else (None, "")
            rel = str(path.relative_to(REPO))
            found.append(Block(rel, i + 1, fence["lang"], text, kind, note, section))
            i = end + 1
    return found


def commands(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and heredoc bodies dropped."""
    out: list[str] = []
    joined = text.replace("\\\n", " ")
    heredoc: str | None = None
    for line in joined.split("\n"):
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<'?(\w+)'?", line):
            heredoc = m[1]
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def substitute(text: str, work: str, port: str) -> str:
    """What a `run` block becomes on the test machine: `"cuda"` → `"cpu"` (no GPU), `/tmp/` → a fresh folder of
    the test's, the docs' port 8880 → a free one. Hub ids stay as written: the test's hub cache holds the test
    model under them."""
    return text.replace('"cuda"', '"cpu"').replace("/tmp/", f"{work}/").replace(DOC_PORT, port)


# ------------------------------------------------------------------------------------------- the block runner
def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready in {timeout:.0f} s") from None
            time.sleep(0.2)


async def _run_python(source: str, namespace: dict) -> None:
    code = compile(source, "<doc block>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # noqa: S307 - the repository's own documentation
    if inspect.iscoroutine(result):
        await result


def _run_bash(source: str) -> None:
    from orpheus_tts_plugin.cli import main

    for command in commands(source):
        argv = command.split()
        if argv[0] != "orpheus-tts":
            raise ValueError(f"a run block runs only orpheus-tts commands: {command!r}")
        import shlex

        rc = main(shlex.split(command)[1:])
        if rc not in (0, None):
            raise RuntimeError(f"{command!r} exited with {rc}")


def run_spec(spec: dict) -> dict[str, dict]:
    """Run the blocks of `spec` ({"work", "port", "blocks": [Block + epilogue]}) in order; block id → its error
    (None if it ran) and its seconds."""
    results: dict[str, dict] = {}
    servers: list[subprocess.Popen] = []
    current = None
    try:
        for b in spec["blocks"]:
            if b["path"] != current:  # a file's servers serve only its own blocks
                for proc in servers:
                    proc.terminate()
                    proc.wait(timeout=30)
                servers, current = [], b["path"]
            work = Path(spec["work"]) / re.sub(r"\W", "_", f"{b['path']}_{b['line']}")
            work.mkdir(parents=True, exist_ok=True)
            os.chdir(work)
            source = substitute(b["text"], str(work), spec["port"])
            started, error = time.monotonic(), None
            try:
                if b["kind"] == "server":
                    (command,) = commands(source)
                    argv = command.split()
                    assert argv[:2] == ["orpheus-tts", "serve"], command
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "orpheus_tts_plugin.cli", *argv[1:], "--host", "127.0.0.1"],
                        stdout=open(work / "server.log", "wb"),
                        stderr=subprocess.STDOUT,
                    )
                    servers.append(proc)
                    _wait_ready(f"http://127.0.0.1:{spec['port']}/ready", proc)
                elif b["lang"] == "python":
                    namespace: dict = {"__name__": "__doc_block__"}
                    asyncio.run(_run_python(source + "\n" + b.get("epilogue", ""), namespace))
                else:
                    _run_bash(source)
            except BaseException:  # noqa: BLE001 - reported per block
                error = traceback.format_exc(limit=-6)
            results[f"{b['path']}:{b['line']}"] = {"error": error, "s": round(time.monotonic() - started, 2)}
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=30)
    return results


def hub_cache(cache: Path, test_model: Path) -> Path:
    """A Hugging Face cache holding the test model under the real hub ids (as huggingface_hub lays it out)."""
    for repo, folder in (("canopylabs/orpheus-3b-0.1-ft", "orpheus"), ("hubertsiuzdak/snac_24khz", "snac")):
        root = cache / f"models--{repo.replace('/', '--')}"
        snapshot = root / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text("0" * 40)
        for f in (test_model / folder).iterdir():
            if not (snapshot / f.name).exists():
                (snapshot / f.name).symlink_to(f)
    return cache


def block_spec(block: Block, epilogue: str = "") -> dict:
    return {**asdict(block), "epilogue": epilogue}


if __name__ == "__main__":
    spec_path, results_path = sys.argv[1:3]
    outcome = run_spec(json.loads(Path(spec_path).read_text()))
    Path(results_path).write_text(json.dumps(outcome))
    sys.stdout.flush()
    os._exit(0)  # engines' daemon threads and shared engines need no orderly shutdown here
