"""`POST /v1/audio/speech`, compatible with OpenAI's: JSON in, audio streamed out with chunked transfer.

Every OpenAI `response_format` (mp3 by default, opus, aac, flac, wav, pcm: `encoders.py`), each chunk encoded as it
arrives; `stream_format: "sse"` sends the same bytes as base64 `speech.audio.delta` events, then one
`speech.audio.done` with `usage` (the prompt's and the generated ids, `types.Usage`). `speed` is stretched by the
engine (pitch kept); `instructions` are accepted and ignored (Orpheus takes emotion tags in the text), said once in
the log and in every response's `X-Orpheus-Instructions` header. OpenAI's voice names map onto the model's voices
(`VOICE_ALIASES`, overridden by `serve --voice-alias NAME=VOICE`).

The response starts once the first audio exists, so that a refusal (bad input 400, overloaded or draining 503) is a
status code, not a broken stream. An engine failure after that ends an SSE stream with an `error` event (OpenAI's
error object under "error", the shape the `openai` SDK raises APIError for) and an audio stream with a truncated
body (the connection closes before the chunked body's end), which HTTP clients raise on. A client that closes the
connection aborts the engine request (Starlette cancels the response task on `http.disconnect`); one that stops
reading has its generation paused by the engine and, past `slow_consumer_timeout_s` without taking a chunk, its
connection cut (the response is left incomplete, so the client sees a truncated body, not a clean end).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Send

from ..config import SAMPLING_FIELDS, SamplingOverrides, check_speed
from ..errors import EngineError
from ..spec import SAMPLE_RATE
from ..types import AudioChunk, Usage
from ..wire import protocol
from .encoders import DEFAULT_FORMAT, FORMATS, AudioFormat, Encoder
from .http_errors import error_object, error_response
from .policy import LimitError, Policy
from .service import Service

log = logging.getLogger(__name__)

OPENAI_FIELDS = ("model", "input", "voice", "response_format", "speed", "stream_format", "instructions")
OWN_FIELDS = ("adapter",)  # beside OpenAI's and the sampling fields: a LoRA adapter of this server's
STREAM_FORMATS = ("audio", "sse")
SSE_CONTENT_TYPE = "text/event-stream"
# OpenAI's voices (openai-python's SpeechCreateParams, Pipecat's VALID_VOICES) onto Orpheus's English voices, by
# the register OpenAI describes for each; a name the model speaks itself is never aliased.
VOICE_ALIASES: dict[str, str] = {
    "alloy": "tara",
    "ash": "leo",
    "ballad": "dan",
    "cedar": "zac",
    "coral": "leah",
    "echo": "dan",
    "fable": "zac",
    "marin": "jess",
    "nova": "jess",
    "onyx": "leo",
    "sage": "mia",
    "shimmer": "zoe",
    "verse": "zac",
}
INSTRUCTIONS_HEADER = "X-Orpheus-Instructions"
_instructions_logged = False  # server loop only: the one-time log line about ignored instructions


class SpeechRequest:
    """A parsed request: what the engine speaks (`start`), and how the audio goes back (format, SSE or not)."""

    __slots__ = ("start", "format", "sse", "instructions")

    def __init__(self, start: protocol.Start, fmt: AudioFormat, sse: bool, instructions: str | None):
        self.start, self.format, self.sse, self.instructions = start, fmt, sse, instructions


def parse_body(body: Any) -> SpeechRequest:
    """The request of a JSON body; TypeError/ValueError naming the field."""
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
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in STREAM_FORMATS:
        raise ValueError(f"stream_format must be one of {', '.join(STREAM_FORMATS)}, got {stream_format!r}")
    speed = check_speed(body["speed"]) if body.get("speed") is not None else 1.0
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise TypeError(f"instructions must be a string, got {type(instructions).__name__}")
    text = body.get("input")
    if not isinstance(text, str):
        raise TypeError(f"input must be a string, got {type(text).__name__}")
    adapter = body.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise TypeError(f"adapter must be a string, got {type(adapter).__name__}")
    sampling = SamplingOverrides.of(**{k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None})
    start = protocol.Start(text, voice or None, sampling, adapter or None, speed)
    return SpeechRequest(start, FORMATS[fmt], stream_format == "sse", instructions or None)


def aliased(voice: str | None, known: tuple[str, ...], aliases: Mapping[str, str]) -> str | None:
    """`voice`, or the model's voice its alias names when the model has no voice of that name."""
    if voice is None or voice in known:
        return voice
    return aliases.get(voice, voice)


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
    global _instructions_logged
    received = time.perf_counter()
    try:
        req = parse_body(await read_json(request, service.policy))
        if not req.start.text.strip():
            raise ValueError("input must not be empty")
        service.policy.check_text(req.start.text)
    except (ValueError, TypeError) as exc:
        service.refused(exc, "http")
        return error_response(exc)
    aliases = {**VOICE_ALIASES, **service.policy.voice_aliases}
    start = req.start
    voice = aliased(start.voice, tuple(service.engine.spec.voices), aliases)
    if voice != start.voice:
        start = protocol.Start(start.text, voice, start.sampling, start.adapter, start.speed)
    headers = {"X-Sample-Rate": str(SAMPLE_RATE)}
    if req.instructions is not None:
        headers[INSTRUCTIONS_HEADER] = "ignored: Orpheus takes emotion tags such as <laugh> in the input"
        if not _instructions_logged:
            _instructions_logged = True
            log.warning("`instructions` are ignored (this is logged once); Orpheus takes emotion tags in the input")
    # A codec opens (up to a few ms: flac's) in a worker thread while the engine makes the first audio.
    if req.format.codec is None:
        opening: asyncio.Future[Encoder] = asyncio.get_running_loop().create_future()
        opening.set_result(Encoder(req.format))
    else:
        opening = asyncio.ensure_future(asyncio.to_thread(Encoder, req.format))
    usage = Usage()
    chunks = service.speak(start, "http", received, key, usage=usage)
    try:
        first: AudioChunk | None = await chunks.__anext__()
    except StopAsyncIteration:  # nothing to say (text of tags or punctuation only): an empty, well-formed body
        first = None
    except (EngineError, ValueError, TypeError) as exc:
        opening.add_done_callback(_close_opened)
        return error_response(exc)
    except BaseException:
        opening.add_done_callback(_close_opened)
        raise
    try:
        encoder = await opening
    except BaseException:
        await chunks.aclose()
        raise
    media_type = SSE_CONTENT_TYPE if req.sse else req.format.content_type
    body = _sse(encoder, first, chunks, usage) if req.sse else _audio(encoder, first, chunks)
    return _DeadlineStreamingResponse(service, body, media_type=media_type, headers=headers)


def _close_opened(opening: asyncio.Future[Encoder]) -> None:
    """Close an encoder opened for a request refused meanwhile."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


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
        except EngineError as exc:  # counted by Service.speak; the body is left incomplete: the client sees it failed
            log.warning("an HTTP audio stream failed after its first audio (its body ends truncated): %s", exc)
        finally:
            await self._body.aclose()


async def _encoded(
    encoder: Encoder, first: AudioChunk | None, rest: AsyncGenerator[AudioChunk, None]
) -> AsyncGenerator[tuple[bytes, int], None]:
    """(encoded bytes, samples so far) as the chunks arrive, then the encoder's tail; closing it (client gone,
    response cancelled) closes the engine stream at once. Encoding runs in a worker thread (raw PCM needs none)."""
    coded = encoder.format.codec is not None
    samples = 0
    try:
        head = encoder.header()
        if head:
            yield head, samples
        if first is not None:
            chunk: AudioChunk | None = first
            while chunk is not None:
                samples += chunk.num_samples
                data = await asyncio.to_thread(encoder.encode, chunk.pcm) if coded else chunk.pcm
                if data:
                    yield data, samples
                chunk = await anext(rest, None)
        tail = await asyncio.to_thread(encoder.finish) if coded else b""
        if tail:
            yield tail, samples
    finally:
        await rest.aclose()
        encoder.close()


async def _audio(
    encoder: Encoder, first: AudioChunk | None, rest: AsyncGenerator[AudioChunk, None]
) -> AsyncGenerator[bytes, None]:
    """The body of `stream_format: audio`: the encoded bytes as they are."""
    async with contextlib.aclosing(_encoded(encoder, first, rest)) as pieces:
        async for data, _ in pieces:
            yield data


async def _sse(
    encoder: Encoder, first: AudioChunk | None, rest: AsyncGenerator[AudioChunk, None], usage: Usage
) -> AsyncGenerator[bytes, None]:
    """The body of `stream_format: sse`, as OpenAI's API reference has it: `speech.audio.delta` events with the
    encoded bytes in base64 `audio`, then one `speech.audio.done` with the stream's `usage`; or, if the engine fails
    on the way, an `error` event and nothing after it."""
    try:
        async with contextlib.aclosing(_encoded(encoder, first, rest)) as pieces:
            async for data, _ in pieces:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
    except (EngineError, ValueError, TypeError) as exc:  # counted by Service.speak
        log.warning("an SSE speech stream failed after its first audio: %s", exc)
        yield _event({"type": "error", "error": error_object(exc)})
        return
    yield _event({"type": "speech.audio.done", "usage": usage.as_dict()})


def _event(message: dict[str, Any]) -> bytes:
    """One server-sent event: a `data:` line of JSON and the blank line that ends it."""
    return b"data: " + json.dumps(message, separators=(",", ":")).encode() + b"\n\n"
