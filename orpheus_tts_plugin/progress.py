"""Progress of a long start-up step (compiling decoder buckets): a tqdm bar if tqdm is installed, else log lines."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def progress(what: str) -> Callable[[int, int], None]:
    """A progress callback (done, total): a tqdm bar on stderr if tqdm is installed, else log lines."""
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda done, total: log.info("%s: %d/%d", what, done, total)
    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc=what, unit="bucket"))
        bar[0].update(done - bar[0].n)
        if done == total:
            bar[0].close()

    return update
