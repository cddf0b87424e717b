"""The FastAPI app of `orpheus-tts serve`: the multiplexed WebSocket, OpenAI speech, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ..engine import OrpheusEngine
from ..errors import missing_extra

try:
    from fastapi import FastAPI, Request, WebSocket
    from fastapi.responses import JSONResponse, Response
except ImportError as exc:
    raise missing_extra("server", "orpheus-tts serve", exc) from None

from . import protocol
from .mux import Mux
from .service import Service
from .speech import speech

STATUS_INTERVAL_S = 0.25  # how often load changes are pushed to WebSocket clients


def create_app(engine: OrpheusEngine, *, own_engine: bool = True) -> FastAPI:
    """An app serving `engine`; it starts loading the engine on start-up and, if `own_engine`, closes it on exit.

    `app.state.service` is the `Service` (drain, readiness, metrics) that `serve.py` drives.
    """
    service = Service(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.prewarm()  # /ready says "starting" until it has loaded
        publisher = asyncio.create_task(service.publish_changes(STATUS_INTERVAL_S), name="orpheus-status")
        try:
            yield
        finally:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
            if own_engine:
                await engine.aclose()

    app = FastAPI(title="orpheus-tts serve", lifespan=lifespan)
    app.state.service = service

    @app.websocket(protocol.WS_PATH)
    async def stream(websocket: WebSocket) -> None:
        await Mux(websocket, service).run()

    @app.post("/v1/audio/speech")
    async def audio_speech(request: Request) -> Response:
        return await speech(request, service)

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
