"""What `orpheus-tts serve` accepts from a client: its key, how much it may send, how many streams it may hold.

Every limit has a default fit for a server on a shared network; `serve --help` names a flag for each.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import MAX_TEXT_CHARS, check_int, check_number, check_text_length
from ..errors import EngineError, EngineOverloadedError

KEYS_ENV = "ORPHEUS_API_KEYS"  # comma-separated keys, added to --api-key and --api-key-file
OPEN_PATHS = frozenset({"/health", "/ready"})  # answered without a key (probes); /metrics too unless metrics_key


class LimitError(ValueError):
    """A request over one of the server's limits (HTTP 413, or an `error` for its stream)."""


class StreamLimitError(EngineOverloadedError):
    """A client at its share of the streams (per connection or per key): HTTP 429, retryable."""


class SlowConsumerError(EngineError):
    """A client that left a stream's audio unread too long: the stream ends so that it holds no engine row."""


@dataclass(frozen=True)
class Policy:
    """The server's admission rules; immutable, read from any thread."""

    api_keys: frozenset[str] = frozenset()  # empty: no key needed (a warning at start off loopback)
    metrics_key: str | None = None  # /metrics needs this key; None: /metrics is open like /health
    max_chars: int = MAX_TEXT_CHARS  # characters of text per request (the engine's default: OpenAI's for `input`)
    max_message_bytes: int = 65_536  # a WebSocket message or an HTTP request body
    max_json_depth: int = 8  # nesting of objects and lists in a request
    streams_per_connection: int | None = None  # open streams per WebSocket; None: fair_share()
    streams_per_key: int | None = None  # open streams per key; None: fair_share()
    send_buffer_s: float = 5.0  # seconds of a stream's audio the server queues for a client that does not read
    slow_consumer_timeout_s: float = 10.0  # a stream whose full buffer is not read for this long ends
    auth_timeout_s: float = 5.0  # a WebSocket without the key in its headers must send `auth` within this
    header_timeout_s: float = 10.0  # a connection must complete its first request's headers within this
    # OpenAI voice names (or any) onto the model's voices, over speech.VOICE_ALIASES (serve --voice-alias NAME=VOICE)
    voice_aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("an API key must be a non-empty string")
        for name in ("max_chars", "max_message_bytes", "max_json_depth"):
            check_int(name, getattr(self, name), 1)
        for name in ("streams_per_connection", "streams_per_key"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        for name in ("send_buffer_s", "slow_consumer_timeout_s", "auth_timeout_s", "header_timeout_s"):
            check_number(name, getattr(self, name), lo=0.0, lo_open=True)

    def key_accepted(self, presented: str | None) -> bool:
        """Whether `presented` is one of the API keys (True when the server has none)."""
        return not self.api_keys or _matches(presented, self.api_keys)

    def refuses(self, path: str, presented: str | None) -> str | None:
        """Why a request to `path` with key `presented` is refused (None: let in). /health and /ready are open;
        /metrics needs `metrics_key` if one is set, else is open; every other path needs an API key, if any."""
        if path in OPEN_PATHS or (path == "/metrics" and self.metrics_key is None):
            return None
        if path == "/metrics":
            accepted = _matches(presented, {self.metrics_key or ""})
        else:
            accepted = self.key_accepted(presented)
        if accepted:
            return None
        return "no API key given" if presented is None else "the API key is not valid"

    def fair_share(self, max_streams: int) -> int:
        """The default streams per connection and per key: half of the engine's with several keys (several
        clients that must not starve one another), all of them otherwise (one agent process per server)."""
        return max(1, max_streams // 2) if len(self.api_keys) > 1 else max_streams

    def connection_streams(self, max_streams: int) -> int:
        return self.streams_per_connection or self.fair_share(max_streams)

    def key_streams(self, max_streams: int) -> int:
        return self.streams_per_key or self.fair_share(max_streams)

    def check_text(self, text: str) -> None:
        """LimitError naming the limit if `text` is over `max_chars`."""
        check_text_length(text, self.max_chars, "this server's", LimitError)

    def check_depth(self, value: Any) -> None:
        """ValueError (a 400, not a size's 413) if `value` (parsed JSON) nests deeper than max_json_depth."""
        level, todo = 0, [value]
        while todo:
            level += 1
            if level > self.max_json_depth:
                raise ValueError(f"JSON nested deeper than this server's limit of {self.max_json_depth} levels")
            todo = [
                item
                for v in todo
                for item in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
                if isinstance(item, (dict, list))
            ]


def _matches(presented: str | None, keys: Iterable[str]) -> bool:
    """Whether `presented` is one of `keys`, in a time independent of where they differ (digests, every key)."""
    if presented is None:
        return False
    digest = hashlib.sha256(presented.encode()).digest()
    found = False
    for key in keys:  # no early exit
        found |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return found


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (None if absent or of another scheme)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def load_keys(
    keys: Iterable[str] = (), key_file: str | None = None, environ: dict[str, str] | None = None
) -> frozenset[str]:
    """Keys from flags, a file (one per line, `#` comments) and ORPHEUS_API_KEYS; ValueError naming a bad file."""
    found = {k.strip() for k in keys if k.strip()}
    env = os.environ if environ is None else environ
    found |= {k.strip() for k in env.get(KEYS_ENV, "").split(",") if k.strip()}
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {key_file}: {exc.strerror or exc}") from None
        found |= {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    return frozenset(found)
