"""Fixtures of the client tests: an engine behind a server thread and a RemoteEngine on it, built once a module
and shared with tests/server/ (tests/served.py)."""

from tests.served import config, long_served, remote, served

__all__ = ["config", "long_served", "remote", "served"]
