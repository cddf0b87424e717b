"""One stream per HTTP request (`POST protocol.STREAMS_PATH`): what a client sends behind a proxy that balances
requests one by one but routes a WebSocket once for its whole life (Ray Serve's), so that streams spread.

The body is a `start` message (its id is ignored); the response carries that stream's messages as the WebSocket
would, framed (`protocol.frame`): audio frames, then `end` or `error`. A request refused before it starts still
answers 200 with one `error` message: one error path for the client. A client that goes away (a cancel) closes
the engine stream at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from ..errors import EngineError
from ..wire import protocol
from .service import Service
from .speech import _DeadlineStreamingResponse, read_json

SID = 0  # the stream id in this stream's audio frames and messages (one stream per response)


async def http_stream(request: Request, service: Service, key: str | None) -> Response:
    """The endpoint: the stream's framed messages, sent as they come (every send within the slow-consumer limit)."""
    received = time.perf_counter()
    try:
        message = await read_json(request, service.policy)
        if not isinstance(message, dict):
            raise TypeError("the request body must be a JSON `start` message")
        start = protocol.Start.parse(message)
        service.policy.check_text(start.text)
    except (ValueError, TypeError) as exc:
        service.refused(exc, "http-stream")
        body = _refused(exc)
    else:
        body = _messages(service, start, received, key)
    return _DeadlineStreamingResponse(service, body, media_type="application/octet-stream")


async def _refused(exc: BaseException) -> AsyncGenerator[bytes, None]:
    yield protocol.frame(protocol.encode(protocol.error(SID, exc)))


async def _messages(
    service: Service, start: protocol.Start, received: float, key: str | None
) -> AsyncGenerator[bytes, None]:
    """The stream's frames; exactly one terminal message (FINAL frame, end or error). Closing it (the client went
    away) closes the engine stream."""
    chunks = service.speak(start, "http-stream", received, key)
    final = False
    try:
        async for chunk in chunks:
            final = chunk.final
            yield protocol.frame(protocol.audio_frame(SID, chunk))
        if not final:
            yield protocol.frame(protocol.encode(protocol.end(SID)))
    except (EngineError, ValueError, TypeError) as exc:
        yield protocol.frame(protocol.encode(protocol.error(SID, exc)))
    finally:
        await chunks.aclose()
