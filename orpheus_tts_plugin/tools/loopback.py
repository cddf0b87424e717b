"""Probes of servers on this host: a free port to start one on, and the HTTP status a path answers with.

Shared by `orpheus-tts load`, scripts/hostile_checks.py, the phone agent demo and the tests that start servers
(tests/servers.py); standard library only.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS picks it; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(port: int, path: str) -> int | None:
    """GET http://127.0.0.1:`port``path`'s status (an error status too), or None if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None
