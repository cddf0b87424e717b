"""The server half of one WebSocket connection: many streams at once, one task per stream, one writer."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any

from starlette.websockets import WebSocket

from ..errors import EngineError
from ..spec import SAMPLE_RATE
from ..speculation import Speculation
from ..wire import protocol
from .policy import SlowConsumerError, StreamLimitError, bearer
from .service import Service

log = logging.getLogger(__name__)

BYTES_PER_S = 2 * SAMPLE_RATE  # int16 mono
MAX_HELD_SPECULATIONS = 1024  # a connection's speculative streams over but not settled; past it the oldest is discarded


class Mux:
    """Reads `start`/`cancel`/`confirm`/`stats` messages, runs a task per stream, sends everything through one writer.

    Everything here runs on the server's event loop. The writer owns the socket's send side, so
    stream tasks never wait on one another's sends.
    """

    def __init__(self, websocket: WebSocket, service: Service):
        self.ws = websocket
        self.service = service
        self._tasks: dict[int, asyncio.Task[None]] = {}  # live streams by client stream id
        self._cancelled: set[int] = set()  # ids whose cancel arrived while their task still runs
        self._held: dict[int, Speculation] = {}  # speculative streams not settled yet, by id (oldest first)
        self._confirmed_early: set[int] = set()  # ids confirmed before their task took its speculation
        self._out: collections.deque[tuple[int | None, str | bytes]] = collections.deque()  # (audio's stream, item)
        self._unsent: collections.Counter[int] = collections.Counter()  # audio bytes queued, by stream
        self._progress: dict[int, asyncio.Event] = {}  # set by the writer as it sends a waiting stream's audio
        self._wake = asyncio.Event()
        self._open = True
        self.key: str | None = None  # the API key this connection authenticated with (None: the server has none)

    async def run(self) -> None:
        """Serve the connection until the client goes away; every stream still open is then aborted."""
        await self.ws.accept()
        if not await self._authenticate():
            return
        self.send(protocol.encode(self.service.hello().message()))
        self.send(protocol.encode(self.service.status()))
        writer = asyncio.create_task(self._write(), name="orpheus-ws-writer")
        self.service.subscribers.add(self)
        self.service.metrics.connections.inc()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is not None:
                    self._handle(message["text"])
                else:
                    self._refuse(None, protocol.ProtocolError("binary messages are not accepted"))
        finally:
            self._open = False
            self.service.subscribers.discard(self)
            self.service.metrics.connections.dec()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            writer.cancel()
            await asyncio.gather(writer, *tasks, return_exceptions=True)
            for speculation in self._held.values():  # its client is gone: none of them will be played
                speculation.discard()
            self._held.clear()

    async def _authenticate(self) -> bool:
        """With API keys: the key from the `Authorization: Bearer` header or, without one, from an `auth`
        message within `auth_timeout_s`; a missing or wrong key closes the connection with 1008."""
        policy = self.service.policy
        if not policy.api_keys:
            return True
        presented = bearer(self.ws.headers.get("authorization"))
        if presented is None:
            presented = await self._auth_message(policy.auth_timeout_s)
        why = policy.refuses(protocol.WS_PATH, presented)
        if why is None:
            self.key = presented
            return True
        self.service.metrics.auth_failures.labels("ws").inc()
        with contextlib.suppress(Exception):  # the client may be gone already
            await self.ws.close(code=protocol.CLOSE_KEY_REFUSED, reason=why)
        return False

    async def _auth_message(self, timeout_s: float) -> str | None:
        """The key of a first `{"type": "auth", "key": KEY}` message (None if another message, none in time)."""
        try:
            message = await asyncio.wait_for(self.ws.receive(), timeout_s)
            reply = protocol.decode(message.get("text") or "")
        except (asyncio.TimeoutError, ValueError):
            return None
        key = reply.get("key")
        return key if reply["type"] == "auth" and isinstance(key, str) else None

    # ---------------------------------------------------------------- incoming
    def _handle(self, text: str) -> None:
        received = time.perf_counter()
        sid: int | None = None
        policy = self.service.policy
        try:
            message = protocol.decode(text)
            policy.check_depth(message)
            kind = message["type"]
            if kind == "auth":  # a key-less client says it has none; past authentication there is nothing to do
                return
            if kind == "stats":
                self.send(protocol.encode({"type": "stats", "req": message.get("req"), "stats": self.service.stats()}))
                return
            sid = protocol.stream_id(message)
            if kind == "cancel":
                self._cancel(sid)
            elif kind == "confirm":
                self._confirm(sid)
            elif kind == "start":
                if sid in self._tasks:  # refused as the connection's: an error with this id would end the live one
                    sid = None
                    raise protocol.ProtocolError(f"stream id {message['id']} is already in use on this connection")
                request = protocol.Start.parse(message)
                policy.check_text(request.text)
                limit = policy.connection_streams(self.service.engine.config.max_streams)
                if len(self._tasks) >= limit:
                    raise StreamLimitError(
                        f"this connection has {limit} streams open, its limit on this server"
                        " (serve --streams-per-connection)"
                    )
                self._tasks[sid] = asyncio.create_task(self._pump(sid, request, received))
            else:
                raise protocol.ProtocolError(f"unknown message type {kind!r}")
        except (ValueError, TypeError, StreamLimitError) as exc:  # ProtocolError is a ValueError: the client's fault
            self.service.refused(exc, "ws")
            self._refuse(sid, exc)

    def _cancel(self, sid: int) -> None:
        """Abort a live stream; discard a speculative one that is over but not settled."""
        task = self._tasks.get(sid)
        if task is not None:  # unknown ids are streams that already ended: nothing to do
            self._cancelled.add(sid)
            task.cancel()
        if (speculation := self._held.pop(sid, None)) is not None:
            speculation.discard()

    def _confirm(self, sid: int) -> None:
        """Confirm a speculative stream, live or over (an id that is neither: already settled, ignored)."""
        if (speculation := self._held.pop(sid, None)) is not None:
            speculation.confirm()
        elif sid in self._tasks:  # its task has not started speaking yet
            self._confirmed_early.add(sid)

    def _hold(self, sid: int, speculation: Speculation) -> None:
        """Keep a speculative stream's speculation until its client confirms or discards it."""
        if sid in self._confirmed_early:
            speculation.confirm()
            return
        if (earlier := self._held.pop(sid, None)) is not None:  # its id reused: the earlier one was never settled
            earlier.discard()
        self._held[sid] = speculation
        if len(self._held) > MAX_HELD_SPECULATIONS:
            self._held.pop(next(iter(self._held))).discard()

    # ---------------------------------------------------------------- one stream
    async def _pump(self, sid: int, request: protocol.Start, received: float) -> None:
        """Send one stream's audio; exactly one terminal message (FINAL frame, end or error) unless cancelled."""
        final = False
        try:
            speaking = self.service.speak(request, "ws", received, self.key, lambda spec: self._hold(sid, spec))
            async with contextlib.aclosing(speaking) as chunks:
                async for chunk in chunks:  # leaving early (a slow consumer) closes the engine stream at once
                    final = chunk.final
                    self.send(protocol.audio_frame(sid, chunk), stream=sid)
                    await self._reader_keeps_up(sid)
            if not final:
                self.send(protocol.encode(protocol.end(sid)))
        except asyncio.CancelledError:
            if sid in self._cancelled and self._open:
                self.send(protocol.encode(protocol.end(sid, cancelled=True)))
        except (EngineError, ValueError, TypeError) as exc:
            if isinstance(exc, SlowConsumerError):
                self.service.metrics.slow_consumers.inc()
            self._refuse(sid, exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must end this stream, not the connection
            log.exception("stream %d failed", sid)
            self._refuse(sid, EngineError(f"server error: {exc!r}"))
        finally:
            self._cancelled.discard(sid)
            self._confirmed_early.discard(sid)
            if (speculation := self._held.get(sid)) is not None and speculation.outcome is not None:
                del self._held[sid]  # settled as it spoke (ended early: discarded)
            self._tasks.pop(sid, None)
            self._progress.pop(sid, None)

    async def _reader_keeps_up(self, sid: int) -> None:
        """Return while the client has less than `send_buffer_s` of this stream's audio unsent; else wait (the
        stream stops taking audio from the engine) until it reads, SlowConsumerError if it sends none of it for
        `slow_consumer_timeout_s`."""
        policy = self.service.policy
        bound = int(policy.send_buffer_s * BYTES_PER_S)
        while self._unsent[sid] > bound:
            progress = self._progress.setdefault(sid, asyncio.Event())
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), policy.slow_consumer_timeout_s)
            except asyncio.TimeoutError:
                unsent = self._unsent[sid] / BYTES_PER_S
                raise SlowConsumerError(
                    f"slow consumer: {unsent:.1f} s of this stream's audio unread for "
                    f"{policy.slow_consumer_timeout_s:g} s"
                ) from None

    # ---------------------------------------------------------------- outgoing
    def send(self, message: str | bytes, stream: int | None = None) -> None:
        """Queue a message for the writer (in order; `stream`: the stream whose audio it is); dropped once the
        connection is closed."""
        if self._open:
            self._out.append((stream, message))
            if stream is not None:
                self._unsent[stream] += len(message)
            self._wake.set()

    def _refuse(self, sid: int | None, exc: BaseException) -> None:
        self.send(protocol.encode(protocol.error(sid, exc)))

    def on_status(self, message: dict[str, Any]) -> None:
        self.send(protocol.encode(message))

    def _sent(self, stream: int, size: int) -> None:
        self._unsent[stream] -= size
        if self._unsent[stream] <= 0:
            del self._unsent[stream]
        if (progress := self._progress.get(stream)) is not None:
            progress.set()

    async def flushed(self) -> None:
        """Return once every queued message has been handed to the socket (or the connection is gone)."""
        while self._out and self._open:
            await asyncio.sleep(0.005)

    async def _write(self) -> None:
        send = self.ws.send
        with contextlib.suppress(Exception):  # the client went away: the reader sees the disconnect and cleans up
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._out:
                    stream, item = self._out.popleft()
                    if isinstance(item, bytes):
                        await send({"type": "websocket.send", "bytes": item})
                    else:
                        await send({"type": "websocket.send", "text": item})
                    if stream is not None:
                        self._sent(stream, len(item))
