"""The FastAPI app of `orpheus-tts serve`: the multiplexed WebSocket, OpenAI speech, voices, health, readiness,
metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ..engine.core import OrpheusEngine
from ..errors import missing_extra

try:
    from fastapi import FastAPI, Request, WebSocket
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.datastructures import Headers
    from starlette.exceptions import HTTPException
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:
    raise missing_extra("server", "orpheus-tts serve", exc) from None

from ..wire import protocol
from . import voices
from .http_errors import error_json
from .http_stream import http_stream
from .mux import Mux
from .policy import Policy, bearer
from .service import Service
from .speech import speech
from .voice_store import VoiceStore, VoiceStoreError

STATUS_INTERVAL_S = 0.25  # how often load changes are pushed to WebSocket clients


def create_app(
    engine: OrpheusEngine,
    *,
    own_engine: bool = True,
    policy: Policy | None = None,
    replica: str | None = None,
    voice_store: VoiceStore | None = None,
) -> FastAPI:
    """An app serving `engine` under `policy` (keys, limits); it starts loading the engine on start-up and, if
    `own_engine`, closes it on exit. `replica`: its name among the replicas behind a balancing proxy (Ray
    Serve): every HTTP response then says it (X-Orpheus-Replica), as does every WebSocket hello. `voice_store`:
    the cloned voices it shares with the deployment's other servers (`shared_voices`; default: its own memory).

    `app.state.service` is the `Service` (drain, readiness, metrics) that `serve.py` drives.
    """
    service = Service(engine, policy, replica, voice_store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.prewarm()  # /ready says "starting" until it has loaded
        with contextlib.suppress(VoiceStoreError):  # the stored voices before the first hello (else run() retries)
            await service.voices.sync()
        tasks = [
            asyncio.create_task(service.publish_changes(STATUS_INTERVAL_S), name="orpheus-status"),
            asyncio.create_task(service.voices.run(), name="orpheus-voices"),
        ]
        try:
            yield
        finally:
            service.voices.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if own_engine:
                await engine.aclose()

    app = FastAPI(title="orpheus-tts serve", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(KeyGuard, service=service)
    if replica is not None:
        app.add_middleware(ReplicaHeader, replica=replica)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return error_json(422, "; ".join(str(e.get("msg", e)) for e in exc.errors()) or "invalid request")

    @app.websocket(protocol.WS_PATH)
    async def stream(websocket: WebSocket) -> None:
        await Mux(websocket, service).run()

    @app.post(protocol.STREAMS_PATH)
    async def one_stream(request: Request) -> Response:
        return await http_stream(request, service, request.scope.get("orpheus.key"))

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request) -> Response:
        return await speech(request, service, request.scope.get("orpheus.key"))

    @app.get("/v1/voices")
    async def voice_list() -> Response:
        """Stock voices, then cloned ones (with their length and transcript)."""
        return await voices.listing(service)

    @app.post("/v1/voices")
    async def voice_add(request: Request) -> Response:
        return await voices.add(request, service)

    @app.delete("/v1/voices/{name}")
    async def voice_remove(name: str) -> Response:
        return await voices.remove(name, service)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the engine loads or serves, 503 once it has failed or closed."""
        state = {**engine.health(), "draining": service.draining}
        return JSONResponse(state, status_code=200 if state["status"] in ("ok", "starting", "not started") else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness for a load balancer: 200 only when a new stream would be admitted now."""
        ok, reason = service.readiness()
        return JSONResponse({"ready": ok, "reason": reason, "load": engine.load}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(service.stats())

    return app


class KeyGuard:
    """ASGI middleware: an HTTP request to a guarded path without its key gets 401 (OpenAI's body) and is counted.

    WebSocket connections pass: `Mux` checks their key (header or a first `auth` message). The key a request
    was let in with is `scope["orpheus.key"]`, for the per-key stream count.
    """

    def __init__(self, app: ASGIApp, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = bearer(Headers(scope=scope).get("authorization"))
        why = self.service.policy.refuses(scope["path"], presented)
        if why is not None:
            self.service.metrics.auth_failures.labels("http").inc()
            await error_json(401, f"{why}: send it as 'Authorization: Bearer KEY'")(scope, receive, send)
            return
        if self.service.policy.api_keys:
            scope["orpheus.key"] = presented
        await self.app(scope, receive, send)


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it (`protocol.REPLICA_HEADER`)."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app = app
        self.header = (protocol.REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)
