"""A RemoteEngine's settings, gathered from its constructor's arguments: where it connects (`RemoteConfig`) and how
it reaches each server (`ConnectOptions`). Both are frozen: read from any thread."""

from __future__ import annotations

import os
import ssl as ssl_module
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .connection import API_KEY_ENV, Connection
from .upstream import server_urls


@dataclass(frozen=True)
class RemoteConfig:
    """Where a RemoteEngine connects and the model it names: what adapters read as `engine.config`."""

    url: str  # its server, or its servers' URLs joined by commas
    model: str | None = None  # a label only (adapters show it); the server decides what it runs
    model_family: str = "orpheus-en"
    backend: str = "serve"

    @property
    def urls(self) -> tuple[str, ...]:
        """Each server's URL, in the order given."""
        return server_urls(self.url)


@dataclass(frozen=True)
class ConnectOptions:
    """How a RemoteEngine reaches each of its servers (RemoteEngine's constructor says what each means)."""

    ssl: ssl_module.SSLContext | None
    api_key: str | None  # None: Connection.open takes $ORPHEUS_API_KEY
    connect_timeout_s: float
    backoff_s: tuple[float, float]
    keepalive_s: tuple[float, float] | None

    async def connect(
        self, url: str, on_status: Callable[[dict[str, Any]], None], on_close: Callable[[str], None]
    ) -> Connection:
        """One connection to `url` with these TLS, key, timeout and keepalive settings (an `upstream.Connect`)."""
        return await Connection.open(
            url,
            ssl=self.ssl,
            api_key=self.api_key,
            timeout_s=self.connect_timeout_s,
            keepalive_s=self.keepalive_s,
            on_status=on_status,
            on_close=on_close,
        )

    def posts_options(self) -> tuple[Any, ...]:
        """StreamPosts' (ssl, api_key, connect_timeout_s[, silence_s]) for a server behind Ray Serve's proxy: the key
        as of now; with no keepalive, a posted stream is not given up for its silence either."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        options = (self.ssl, key, self.connect_timeout_s)
        return options if self.keepalive_s is not None else (*options, None)
