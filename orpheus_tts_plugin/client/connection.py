"""The client half of the WebSocket protocol: one connection carrying many streams, on the loop that opened it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import ssl as ssl_module
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import EngineError, KeyRefusedError, missing_extra
from ..types import AudioChunk

try:
    from websockets.asyncio.client import ClientConnection, connect, unix_connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
except ImportError as exc:
    raise missing_extra("server", "RemoteEngine", exc) from None
from ..runtime.mailbox import Mailbox
from ..wire import protocol

log = logging.getLogger(__name__)

API_KEY_ENV = "ORPHEUS_API_KEY"  # the key a client sends when none is given
CLOSE_TIMEOUT_S = 1.0  # a server answers a close in milliseconds; one that does not (hung) is left after this

Item = AudioChunk | BaseException | None  # a chunk; the error that ends a stream; None: ended, no more audio
Deliver = Callable[[Item], None]


def endpoint(url: str) -> tuple[str, str | None]:
    """(WebSocket URI, Unix socket path or None) for `url`.

    Accepts ws://, wss://, http:// and https:// (the stream path is added when the URL has none), and
    unix:/path/to.sock for a server started with `--uds`.
    """
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"ws://localhost{protocol.WS_PATH}", parts.path
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"url must be ws://HOST:PORT, wss://…, http(s)://… or unix:/PATH, got {url!r}")
    path = parts.path if parts.path not in ("", "/") else protocol.WS_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, "")), None


def _refused(url: str, reason: str, api_key: str | None) -> str:
    """The one line that says a server refused the key, and what to do."""
    if api_key is None:
        return f"{url} needs an API key and none was given ({reason}): pass api_key= or set ${API_KEY_ENV}"
    return f"{url} refused the API key given ({reason}): pass one of the keys it was started with (serve --api-key)"


def to_mailbox(box: Mailbox[AudioChunk]) -> Deliver:
    """A Deliver that feeds `box` on the same loop: chunks in, then the end or the error."""

    def deliver(item: Item) -> None:
        if box.ended:
            return
        if item is None:
            box.end()
        elif isinstance(item, BaseException):
            box.end(item)
        else:
            box.put(item)

    return deliver


@dataclass
class _Sink:
    """A live stream as the reader sees it (connection's loop only)."""

    deliver: Deliver
    samples: int = 0


class Connection:
    """One WebSocket to `orpheus-tts serve`: start and cancel streams, route their frames, report loss.

    `open()` returns once the server's hello and first status have arrived.

    Every method runs on the loop that called `open()`. When the socket closes, every open stream
    is ended with an EngineError at once, and `closed` resolves; `on_close` is called before the first
    stream hears of it, so an owner's state is already "disconnected" when a caller sees the error.
    """

    def __init__(
        self,
        ws: ClientConnection,
        hello: protocol.Hello,
        url: str,
        on_status: Callable[[dict], None] | None,
        on_close: Callable[[str], None] | None,
    ):
        self.url = url
        self.hello = hello
        self.status: dict[str, Any] = {}  # the server's last `status` message
        self._ws = ws
        self._on_status = on_status
        self._on_close = on_close
        self._sinks: dict[int, _Sink] = {}
        self._speculative: set[int] = set()  # speculative streams started here, not confirmed or cancelled yet
        self._ids = itertools.count()
        self._stats: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._out: collections.deque[str] = collections.deque()
        self._wake = asyncio.Event()
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # result: why it closed
        self._reader = asyncio.create_task(self._read(), name="orpheus-remote-reader")
        self._writer = asyncio.create_task(self._write(), name="orpheus-remote-writer")

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        ssl: ssl_module.SSLContext | None = None,
        timeout_s: float = 5.0,
        on_status: Callable[[dict], None] | None = None,
        on_close: Callable[[str], None] | None = None,
        api_key: str | None = None,
        keepalive_s: tuple[float, float] | None = (20.0, 20.0),
    ) -> Connection:
        """Connect (sending `api_key`, default $ORPHEUS_API_KEY, as `Authorization: Bearer`) and wait for the
        server's hello; EngineError if it cannot be reached, refuses the key, or is not a serve endpoint.
        `keepalive_s`: (ping interval, pong timeout); a server that leaves a ping unanswered that long is
        taken as gone, and the connection closes (None: no pings)."""
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        uri, path = endpoint(url)
        ping_interval, ping_timeout = keepalive_s or (None, None)
        options: dict[str, Any] = {
            "compression": None,  # deflate on PCM costs CPU and saves little
            "open_timeout": timeout_s,
            "ping_interval": ping_interval,
            "ping_timeout": ping_timeout,
            "close_timeout": CLOSE_TIMEOUT_S,
            "max_queue": 256,
            "max_size": 2**22,
            "proxy": None,
        }
        if uri.startswith("wss:"):
            options["ssl"] = ssl or ssl_module.create_default_context()
        if api_key is not None:
            options["additional_headers"] = {"Authorization": f"Bearer {api_key}"}

        async def handshake() -> tuple[ClientConnection, protocol.Hello, dict[str, Any]]:
            ws = await (unix_connect(path, uri, **options) if path else connect(uri, **options))
            try:
                if api_key is None:  # says so at once: a server with keys would wait for an auth message
                    await ws.send(protocol.encode(protocol.auth(None)))
                hello = protocol.Hello.parse(protocol.decode(await ws.recv()))
                status = protocol.decode(await ws.recv())  # the server sends its status right after
                if status["type"] != "status":
                    raise protocol.ProtocolError(f"expected status after hello, got {status['type']!r}")
                return ws, hello, status
            except BaseException:
                await ws.close()
                raise

        try:
            ws, hello, status = await asyncio.wait_for(handshake(), timeout_s)
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == protocol.CLOSE_KEY_REFUSED:
                raise KeyRefusedError(_refused(url, exc.rcvd.reason, api_key)) from None
            raise EngineError(f"cannot connect to {url}: {type(exc).__name__}: {exc}") from exc
        except (
            OSError,
            asyncio.TimeoutError,
            InvalidHandshake,
            InvalidURI,
            protocol.ProtocolError,
        ) as exc:
            raise EngineError(f"cannot connect to {url}: {type(exc).__name__}: {exc}") from exc
        conn = cls(ws, hello, url, on_status, on_close)
        conn.status = status
        return conn

    # ---------------------------------------------------------------- streams
    def start(self, request: protocol.Start, deliver: Deliver) -> int:
        """Send `start`; `deliver` then gets this stream's chunks and its end. Returns the stream id."""
        if self.closed.done():
            raise EngineError(f"connection to {self.url} is closed")
        sid = next(self._ids) % (protocol.MAX_STREAM_ID + 1)
        self._sinks[sid] = _Sink(deliver)
        if request.speculative:
            self._speculative.add(sid)
        self._send(protocol.encode(request.message(sid)))
        return sid

    def cancel(self, sid: int) -> None:
        """Forget a stream and send `cancel` at once (nothing more reaches its deliver); for a speculative stream
        that is over but not confirmed, the `cancel` discards it."""
        live = self._sinks.pop(sid, None) is not None
        held = sid in self._speculative
        self._speculative.discard(sid)
        if (live or held) and not self.closed.done():
            self._send(protocol.encode(protocol.cancel(sid)))

    def confirm(self, sid: int) -> None:
        """Confirm a speculative stream, live or over: its audio will be played (sent once)."""
        if sid in self._speculative:
            self._speculative.discard(sid)
            if not self.closed.done():
                self._send(protocol.encode(protocol.confirm(sid)))

    async def stream(self, request: protocol.Start) -> AsyncGenerator[AudioChunk, None]:
        """One stream's chunks, as OrpheusEngine.synthesize yields them; leaving early cancels it on the server."""
        box: Mailbox[AudioChunk] = Mailbox()
        sid = self.start(request, to_mailbox(box))
        complete = False
        try:
            while not complete:
                try:
                    chunk = await box.get()
                except StopAsyncIteration:
                    complete = True
                    return
                complete = chunk.final
                yield chunk
        finally:
            if not complete and not box.ended:
                self.cancel(sid)

    async def server_stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The server's stats (engine counters, load, process CPU seconds)."""
        req = next(self._ids)
        fut = self._stats[req] = asyncio.get_running_loop().create_future()
        self._send(protocol.encode({"type": "stats", "req": req}))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._stats.pop(req, None)

    async def aclose(self, error: BaseException | None = None, *, notify: bool = True) -> None:
        """Close the socket; open streams end with `error` (default: an EngineError saying so). `notify=False`:
        without calling `on_close` (its owner is done with it, the server is not gone)."""
        if not notify:
            self._on_close = None
        self._end_all(error or EngineError(f"connection to {self.url} closed"))
        self._writer.cancel()
        with contextlib.suppress(Exception):
            await self._ws.close()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)

    # ---------------------------------------------------------------- socket
    def _send(self, text: str) -> None:
        self._out.append(text)
        self._wake.set()

    async def _write(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._out:
                    await self._ws.send(self._out.popleft())

    async def _read(self) -> None:
        reason = "closed"
        try:
            async for message in self._ws:
                if isinstance(message, bytes):
                    self._on_audio(message)
                else:
                    self._on_message(protocol.decode(message))
        except ConnectionClosed as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a broken server message ends the connection, never hangs it
            log.exception("bad message from %s", self.url)
            reason = f"bad message from the server: {exc!r}"
        finally:
            self._end_all(EngineError(f"connection to {self.url} lost ({reason})"))
            self._writer.cancel()

    def _on_audio(self, data: bytes) -> None:
        sid = protocol.audio_stream_id(data)
        sink = self._sinks.get(sid)
        if sink is None:  # cancelled here while the frame was in flight
            return
        chunk = protocol.parse_audio(data, sink.samples)
        sink.samples += chunk.num_samples
        if chunk.final:
            del self._sinks[sid]
        sink.deliver(chunk)

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind in ("end", "error"):
            sid = message.get("id")
            sink = self._sinks.pop(sid, None) if sid is not None else None
            if sink is not None:
                sink.deliver(None if kind == "end" else protocol.exception(message))
            elif kind == "error" and sid is None:
                log.warning("server %s: %s", self.url, message.get("message"))
        elif kind == "status":
            self.status = message
            if self._on_status is not None:
                self._on_status(message)
        elif kind == "stats":
            fut = self._stats.get(message.get("req"))
            if fut is not None and not fut.done():
                fut.set_result(message["stats"])

    def _end_all(self, error: BaseException) -> None:
        if not self.closed.done():
            self.closed.set_result(str(error))
            if self._on_close is not None:
                self._on_close(str(error))
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.deliver(error)
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(error)
