"""What every benchmark shares: CPU timing, run metadata, tables and JSON (no torch at import)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(process CPU seconds across all threads, wall seconds, result) of fn()."""
    c0, w0 = time.process_time(), time.perf_counter()
    result = fn()
    return time.process_time() - c0, time.perf_counter() - w0, result


def median_ms(fn: Callable[[], Any], calls: int, warmup: int = 3) -> float:
    """Median wall milliseconds of fn() over `calls` calls, after `warmup` untimed ones."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def print_rows(rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """A table with one line per row dict: `columns` maps each shown key to its header."""
    cells = [[_shown(row.get(key)) for key in columns] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(columns.values())]
    for line in [list(columns.values()), *cells]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run_metadata() -> dict[str, Any]:
    """Date, machine, command and commit of a benchmark run: what docs/benchmarks.md quotes beside each figure."""
    import datetime
    import os
    import platform
    import subprocess
    import sys

    import torch

    try:
        root = Path(__file__).resolve().parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{cpu_model()}, {cpus} CPUs" + (f", {cuda}" if cuda else ", no GPU"),
        "cpu_model": cpu_model(),
        "cpus": cpus,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "blas": blas(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,  # others' work on the machine
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": commit or None,
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas() -> str:
    """The BLAS torch was built with, as `torch.__config__` names it (e.g. "mkl", "open")."""
    import re

    import torch

    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def host_line() -> str:
    """One line naming the host for a printed figure: CPU model, cores, torch, BLAS."""
    meta = run_metadata()
    return f"host: {meta['machine']}, torch {meta['torch']}, BLAS {meta['blas']} ({meta['cpu_capability']})"


def print_table(result: dict[str, Any]) -> None:
    """A two-column table of a result dict."""
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {_shown(value)}")


def write_json(result: dict[str, Any], path: str | None) -> None:
    """Write `result` as indented JSON to `path` (nothing if no path)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
