"""The client half of `POST protocol.STREAMS_PATH`: each stream one HTTP request over a pool of kept-alive
connections, on the loop that owns it (a RemoteEngine's connection loop).

Used when a server's hello names `streams_path`: a proxy in front (Ray Serve's) then routes each stream by itself
to the least-loaded replica, where a WebSocket would be routed once and pin every stream to one replica. A stream
that ends whole gives its connection back to the pool; a cancelled one closes its connection, which the proxy
and the server see as the client gone (the engine stream is aborted).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import ssl as ssl_module
from typing import Any

from ..errors import EngineError, EngineOverloadedError, missing_extra
from . import protocol
from .connection import Deliver

try:
    import aiohttp
except ImportError as exc:
    raise missing_extra("server", "RemoteEngine behind Ray Serve", exc) from None


RETRIES = 3  # tries of a stream refused at capacity before its first audio
RETRY_S = 0.05  # the wait before the second try (doubled for the next)


class StreamPosts:
    """Streams as HTTP requests to one base URL; every method runs on the loop that created it."""

    def __init__(self, base_url: str, ssl: ssl_module.SSLContext | None, api_key: str | None, connect_timeout_s: float):
        self.base_url = base_url  # http(s)://HOST:PORT, without a path
        self._ssl = ssl
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None  # made at the first stream, on this loop
        self._tasks: dict[int, tuple[asyncio.Task[None], Deliver]] = {}  # live streams by id
        self._ids = itertools.count()
        self.replicas: collections.Counter[str] = collections.Counter()  # streams started, by replica that served
        self.connects = 0  # connections opened (a cancelled stream's is closed; a finished one's is reused)

    def start(self, path: str, request: protocol.Start, deliver: Deliver) -> int:
        """POST `request` to `path`; `deliver` then gets its chunks and its end. Returns the stream's id."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(self._connected)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers, trace_configs=[trace]
            )
        sid = next(self._ids)
        self._tasks[sid] = (asyncio.create_task(self._run(sid, self.base_url + path, request, deliver)), deliver)
        return sid

    async def _connected(self, *_: Any) -> None:
        self.connects += 1

    def __contains__(self, sid: int) -> bool:
        return sid in self._tasks

    def cancel(self, sid: int) -> None:
        """Abort a stream: its connection closes (the server stops its work); nothing more reaches its deliver."""
        task, _ = self._tasks.pop(sid, (None, None))
        if task is not None:
            task.cancel()

    async def aclose(self, error: BaseException) -> None:
        """End every open stream with `error` and close the pool."""
        live, self._tasks = self._tasks, {}
        for task, deliver in live.values():
            task.cancel()
            deliver(error)
        await asyncio.gather(*(task for task, _ in live.values()), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self, sid: int, url: str, request: protocol.Start, deliver: Deliver) -> None:
        """One stream, from the POST to its end; a cancel (cancel(), aclose()) delivers nothing more.

        A refusal at capacity before any audio is retried (RETRIES times): the proxy routes on its own count of
        open requests, which does not know a replica's max_streams, and the next try goes to the least loaded of
        two replicas again."""
        try:
            for attempt in range(RETRIES):
                item, heard = await self._read(url, request, deliver)
                if heard or not isinstance(item, EngineOverloadedError) or attempt == RETRIES - 1:
                    break
                await asyncio.sleep(RETRY_S * 2**attempt)  # a replica that just started may not be routed to yet
        except (aiohttp.ClientError, asyncio.IncompleteReadError, OSError, asyncio.TimeoutError) as exc:
            item = EngineError(f"connection to {url} lost ({type(exc).__name__}: {exc})")
        except (ValueError, KeyError) as exc:  # a broken frame: the stream ends, never hangs
            item = EngineError(f"bad message from {url}: {exc!r}")
        self._tasks.pop(sid, None)
        deliver(item)

    async def _read(self, url: str, request: protocol.Start, deliver: Deliver) -> tuple[Any, bool]:
        """Stream the response's audio to `deliver`; (what ends it: the final chunk, None or the error, whether
        any audio came)."""
        async with self._session.post(url, data=protocol.encode(request.message(0))) as resp:
            self.replicas[resp.headers.get(protocol.REPLICA_HEADER, "?")] += 1
            try:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    cls = EngineOverloadedError if resp.status in (429, 503) else EngineError
                    return cls(f"{url} answered HTTP {resp.status}: {text}"), False
                samples = 0
                while True:
                    length, kind = protocol.FRAME.unpack(await resp.content.readexactly(protocol.FRAME.size))
                    payload = await resp.content.readexactly(length)
                    if kind == protocol.FRAME_AUDIO:
                        chunk = protocol.parse_audio(payload, samples)
                        samples += chunk.num_samples
                        if not chunk.final:
                            deliver(chunk)
                            continue
                        end: Any = chunk
                    else:
                        message = protocol.decode(payload.decode())
                        end = None if message["type"] == "end" else protocol.exception(message)
                    await resp.read()  # the body's end: read, the connection goes back to the pool
                    return end, samples > 0
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    resp.close()  # not given back to the pool: closing it is the cancel
                raise
