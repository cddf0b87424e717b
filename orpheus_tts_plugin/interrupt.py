"""Ctrl-C in the `orpheus-tts` command: one line, exit status 130, and no wait on a thread that cannot be stopped."""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

STATUS = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the command still did about it (its message ends the one line)."""


def interrupted(command: str, detail: str = "") -> int:
    """Say in one line that `command` was interrupted; STATUS to exit with, or the end of the process now if
    another thread is still at work."""
    _say(command, detail)
    if any(_at_work(t) for t in threading.enumerate()):
        end_now()
    return STATUS


def end_interrupted(command: str, detail: str = "") -> NoReturn:
    """Say in one line that `command` was interrupted and end the process now (from a signal handler)."""
    _say(command, detail)
    end_now()


def end_now() -> NoReturn:
    """Exit with STATUS at once, every thread with it.

    A model load in progress cannot be stopped, and the interpreter's own exit would wait for it (it joins the
    executor threads a load runs in) or tear it down mid-call in native code (`terminate called ...`).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STATUS)


def _at_work(thread: threading.Thread) -> bool:
    """Whether `thread` would hold up or trouble the interpreter's exit: one it waits for (not a daemon, such as
    the executor thread a load runs in) or one of this package's, in native code for all we know."""
    if thread is threading.current_thread() or not thread.is_alive():
        return False
    return not thread.daemon or thread.name.startswith("orpheus-")


def _say(command: str, detail: str) -> None:
    print(f"orpheus-tts {command}: interrupted" + (f"; {detail}" if detail else ""), file=sys.stderr, flush=True)
