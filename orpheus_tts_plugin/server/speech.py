"""`POST /v1/audio/speech`, compatible with OpenAI's: JSON in, PCM or WAV streamed out with chunked transfer.

The response starts once the first audio exists, so that a refusal (bad input 400, overloaded or
draining 503) is a status code, not a broken stream. A client that closes the connection aborts the
engine request (Starlette cancels the response task on `http.disconnect`); one that stops reading has
its generation paused by the engine and, past `slow_consumer_timeout_s` without taking a chunk, its
connection cut (the response is left incomplete, so the client sees a truncated body, not a clean end).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Send

from ..config import SAMPLING_FIELDS, SamplingOverrides
from ..errors import EngineError
from ..spec import SAMPLE_RATE
from ..types import AudioChunk
from . import protocol
from .http_errors import error_response
from .policy import LimitError, Policy
from .service import Service

log = logging.getLogger(__name__)

FORMATS = {"pcm": "audio/pcm", "wav": "audio/wav"}
DEFAULT_FORMAT = "wav"  # OpenAI's default is mp3, which this server does not encode; WAV describes itself
OPENAI_FIELDS = ("model", "input", "voice", "response_format", "speed", "stream_format", "instructions")
OWN_FIELDS = ("adapter",)  # beside OpenAI's and the sampling fields: a LoRA adapter of this server's


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (sizes 0xFFFFFFFF, as streaming encoders write)."""
    unknown = 0xFFFFFFFF
    rate = sample_rate
    return struct.pack(
        "<4sI8sIHHIIHH4sI", b"RIFF", unknown, b"WAVEfmt ", 16, 1, 1, rate, 2 * rate, 2, 16, b"data", unknown
    )


def parse_body(body: Any) -> tuple[protocol.Start, str]:
    """(request, response format) from the JSON body; TypeError/ValueError naming the field."""
    if not isinstance(body, dict):
        raise TypeError("the request body must be a JSON object")
    known = OPENAI_FIELDS + SAMPLING_FIELDS + OWN_FIELDS
    unknown = set(body) - set(known)
    if unknown:
        raise TypeError(f"unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise TypeError("model must be a non-empty string")
    voice = body.get("voice")
    if isinstance(voice, dict):  # OpenAI's custom-voice form {"id": ...}
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise TypeError(f"voice must be a string or {{'id': string}}, got {type(voice).__name__}")
    fmt = body.get("response_format") or DEFAULT_FORMAT
    if fmt not in FORMATS:
        raise ValueError(f"response_format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    if body.get("stream_format", "audio") != "audio":
        raise ValueError("stream_format must be 'audio' (server-sent events are not supported)")
    if body.get("speed", 1.0) != 1.0:
        raise ValueError("speed must be 1.0 (Orpheus speaks at its own pace)")
    if body.get("instructions"):
        raise ValueError("instructions are not supported; put emotion tags such as <laugh> in the input")
    text = body.get("input")
    if not isinstance(text, str):
        raise TypeError(f"input must be a string, got {type(text).__name__}")
    adapter = body.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise TypeError(f"adapter must be a string, got {type(adapter).__name__}")
    sampling = SamplingOverrides.of(**{k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
    return protocol.Start(text, voice or None, sampling, adapter or None), fmt


async def read_json(request: Request, policy: Policy) -> Any:
    """The request's JSON body, at most `max_message_bytes` and `max_json_depth` deep: LimitError or ValueError."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > policy.max_message_bytes:
        raise LimitError(f"a body of {declared} bytes is over this server's limit of {policy.max_message_bytes}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > policy.max_message_bytes:
            raise LimitError(f"the body is over this server's limit of {policy.max_message_bytes} bytes")
    value = protocol.parse_json(bytes(body))
    policy.check_depth(value)
    return value


async def speech(request: Request, service: Service, key: str | None) -> Response:
    """The endpoint: validate, wait for the first audio, then stream the rest; `key`: the caller's API key."""
    received = time.perf_counter()
    try:
        start, fmt = parse_body(await read_json(request, service.policy))
        if not start.text.strip():
            raise ValueError("input must not be empty")
        service.policy.check_text(start.text)
    except (ValueError, TypeError) as exc:
        service.refused(exc, "http")
        return error_response(exc)
    chunks = service.speak(start, "http", received, key)
    try:
        first: AudioChunk | None = await chunks.__anext__()
    except StopAsyncIteration:  # nothing to say (text of tags or punctuation only): an empty, well-formed body
        first = None
    except (EngineError, ValueError, TypeError) as exc:
        return error_response(exc)
    head = wav_header() if fmt == "wav" else b""
    return _DeadlineStreamingResponse(
        service,
        _body(head, first, chunks),
        media_type=FORMATS[fmt],
        headers={"X-Sample-Rate": str(SAMPLE_RATE)},
    )


class _DeadlineStreamingResponse(StreamingResponse):
    """A streaming response whose every send must finish within `slow_consumer_timeout_s`, else it stops there.

    A send waits while the client's socket is full (the server's flow control), so a client that reads
    nothing holds the send; the stream then ends without its last message, and the server closes the
    connection (a truncated body) and the engine stream with it.
    """

    def __init__(self, service: Service, content: AsyncGenerator[bytes, None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._body = content
        self._service = service

    async def stream_response(self, send: Send) -> None:
        timeout = self._service.policy.slow_consumer_timeout_s

        async def send_in_time(message: Message) -> None:
            await asyncio.wait_for(send(message), timeout)

        try:
            await super().stream_response(send_in_time)
        except TimeoutError:
            self._service.metrics.slow_consumers.inc()
            log.warning("slow consumer: an HTTP client read no audio for %g s; its stream ends", timeout)
        finally:
            await self._body.aclose()


async def _body(
    head: bytes, first: AudioChunk | None, rest: AsyncGenerator[AudioChunk, None]
) -> AsyncGenerator[bytes, None]:
    """The response body; closing it (client gone, response cancelled) closes the engine stream at once."""
    try:
        if head:
            yield head
        if first is None:
            return
        yield first.pcm
        async for chunk in rest:
            yield chunk.pcm
    finally:
        await rest.aclose()
