"""The phone agent server: TwiML endpoint, Twilio Media Streams WebSocket, one pipeline per call, one engine for all.

    python -m examples.pipecat_phone_agent.server --help

Endpoints: `GET|POST /twiml` (point the Twilio number's voice webhook here), `WS /ws` (the media
stream the TwiML connects), `GET /stats` (calls and engine counters, e.g. for load balancing),
`GET /calls/{stream_sid}/moments` (when each latency stage of the call's turns happened).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from xml.sax.saxutils import quoteattr

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from orpheus_tts_plugin.affinity import pin_process

from .bot import read_twilio_start, run_call
from .config import AgentConfig, parse_args
from .stages import AgentResources


def twiml(stream_url: str) -> str:
    """TwiML that connects the call's audio to our media stream WebSocket."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={quoteattr(stream_url)} /></Connect></Response>"
    )


def create_app(config: AgentConfig) -> FastAPI:
    """The FastAPI app; the engine and recognizer load at startup, before the first call is accepted."""
    resources = AgentResources(config)
    calls = {"active": 0, "total": 0}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await resources.start()
        try:
            yield
        finally:
            await resources.close()

    app = FastAPI(lifespan=lifespan)

    @app.api_route("/twiml", methods=["GET", "POST"])
    async def answer(request: Request) -> Response:
        url = config.public_url or f"wss://{request.headers['host']}/ws"
        return Response(twiml(url), media_type="application/xml")

    @app.websocket("/ws")
    async def media_stream(websocket: WebSocket) -> None:
        await websocket.accept()
        call = await read_twilio_start(websocket)
        calls["active"] += 1
        calls["total"] += 1
        try:
            await run_call(websocket, call, resources)
        finally:
            calls["active"] -= 1

    @app.get("/stats")
    async def stats() -> dict:
        return {"calls": dict(calls), "engine": resources.engine.stats()}

    @app.get("/calls/{stream_sid}/moments")
    async def moments(stream_sid: str) -> list:
        """[monotonic seconds, stage] of the call's latency stages (latency.py), for the demo's waterfall."""
        return resources.moments.get(stream_sid, [])

    return app


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if config.cpus is not None:
        pin_process(config.cpus)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
