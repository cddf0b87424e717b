"""`/v1/voices`: the voices a server speaks (`GET`), cloned ones added (`POST`) and removed (`DELETE /v1/voices/NAME`).

Guarded by the API key like every route but the probes (`KeyGuard`). `POST` takes JSON: `name`, `transcript`,
and the reference as `wav` (a base64 16-bit WAV file at 24 kHz) or `pcm` (base64 int16 little-endian mono
PCM at 24 kHz). The reference is encoded in a worker thread and kept in the deployment's voice store
(`shared_voices`): every server of the deployment speaks it, and a removal reaches them all. Connected WebSocket
clients hear the new voice list in their next `status`, new connections in their `hello`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..speech.voices import read_wav
from .http_errors import error_json, error_response
from .policy import LimitError
from .service import Service
from .voice_store import VoiceStoreError

MAX_BODY_BYTES = 4 * 1024 * 1024  # a 30 s reference is 1.44 MB of PCM, 1.92 MB in base64
FIELDS = ("name", "transcript", "wav", "pcm")


async def listing(service: Service) -> JSONResponse:
    """Every voice this server speaks, the store's latest included (a server that cannot reach it lists its own)."""
    with contextlib.suppress(VoiceStoreError):
        await service.voices.sync()
    engine = service.engine
    return JSONResponse({"voices": engine.voices(), "default_voice": engine.spec.default_voice})


def reference(body: Any) -> tuple[str, np.ndarray, str]:
    """(name, audio, transcript) from the JSON body; TypeError/ValueError naming the field."""
    if not isinstance(body, dict):
        raise TypeError("the request body must be a JSON object")
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown field(s) {', '.join(sorted(unknown))}; known: {', '.join(FIELDS)}")
    given = [k for k in ("wav", "pcm") if k in body]
    if len(given) != 1:
        raise TypeError("give the reference audio as exactly one of 'wav' or 'pcm' (base64)")
    try:
        data = base64.b64decode(body[given[0]], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise ValueError(f"{given[0]} is not valid base64") from None
    if given[0] == "wav":
        audio = read_wav(io.BytesIO(data))
    elif len(data) % 2:
        raise ValueError("pcm must be whole int16 samples (an even number of bytes)")
    else:
        audio = np.frombuffer(data, dtype="<i2").astype(np.int16)
    return body.get("name"), audio, body.get("transcript")


async def add(request: Request, service: Service) -> Response:
    """Add a cloned voice: 201 with its listing; 400 bad input (or the name taken), 413 too large, 503 when the
    voice store cannot take it."""
    try:
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise LimitError(f"request body of {len(body)} bytes is over {MAX_BODY_BYTES}")
        try:
            parsed = json.loads(body)
        except ValueError:
            raise ValueError("the request body is not JSON") from None
        name, audio, transcript = reference(parsed)
        await service.voices.add(name, audio, transcript)
    except (ValueError, TypeError, LimitError) as exc:
        return error_response(exc)
    except VoiceStoreError as exc:
        return error_json(503, str(exc))
    service.publish()  # connected clients learn the name now
    [voice] = [v for v in service.engine.voices() if v["name"] == name]
    return JSONResponse(voice, status_code=201)


async def remove(name: str, service: Service) -> Response:
    """Remove a cloned voice from every server: 204; 404 if it is not one, 503 when the voice store cannot be
    reached."""
    try:
        await service.voices.remove(name)
    except KeyError as exc:
        return error_json(404, str(exc.args[0]))
    except VoiceStoreError as exc:
        return error_json(503, str(exc))
    service.publish()
    return Response(status_code=204)
