"""Test-model folders with one file changed: a tokenizer that fails to load, or one whose load never ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def model_with(orpheus: Path, out: Path, name: str, make: Callable[[Path], object]) -> Path:
    """A folder `out` like `orpheus` (its files linked) whose file `name` is made by `make(path)` instead.

    `make=os.mkfifo` on tokenizer_config.json gives a load that blocks for ever on reading it (with the
    interpreter lock released): an engine that is still loading whenever a test looks, on any host."""
    out.mkdir()
    for f in orpheus.iterdir():
        if f.name != name:
            (out / f.name).symlink_to(f)
    make(out / name)
    return out
