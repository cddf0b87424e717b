"""Pinning a process to CPUs (`serve --cpus`): its Python threads share one interpreter lock anyway.

Spread over several CPUs, every hand-off of that lock between the engine's threads (its loop, the stepping
thread, the decoder thread) is a wake-up of another CPU, on a VM a halted vCPU's: on 2 KVM vCPUs one stream
took 2.5× the wall time unpinned (docs/benchmarks.md, "CPU affinity"). On one CPU a hand-off is a context switch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable


def allowed_cpus() -> frozenset[int]:
    """The CPUs this thread may run on (every CPU where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def parse_cpus(text: str) -> frozenset[int]:
    """CPUs from a taskset-style list ("1", "0-3,6"); ValueError in one line for a bad list or a CPU not allowed."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (last.isdigit() if dash else True)):
            raise ValueError(f"CPU list {text!r}: {part.strip()!r} is not a CPU number or a range like 0-3")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"CPU list {text!r}: the range {part.strip()!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    if missing := sorted(cpus - allowed_cpus()):
        allowed = ",".join(map(str, sorted(allowed_cpus())))
        raise ValueError(f"CPU list {text!r}: CPU {missing[0]} is not one this process may use ({allowed})")
    return frozenset(cpus)


def cpu_list(text: str) -> frozenset[int]:
    """`parse_cpus` as an argparse `type=`: its one-line message becomes argparse's."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pin_process(cpus: Iterable[int]) -> None:
    """Run every thread of this process on `cpus` only; threads and processes it starts later inherit that."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("pinning to CPUs needs Linux (os.sched_setaffinity); run without --cpus")
    cpus = frozenset(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # the thread ended since the listing
            pass
