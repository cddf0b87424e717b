"""The phone agent server: TwiML endpoint, Twilio Media Streams WebSocket, one pipeline per call, one engine for all.

    python -m examples.pipecat_phone_agent.server --help

Endpoints: `GET|POST /twiml` (point the Twilio number's voice webhook here), `WS /ws` (the media
stream the TwiML connects), `GET /stats` (calls and engine counters, e.g. for load balancing),
`GET /calls/{stream_sid}/moments` (when each latency stage of the call's turns happened).

Before it listens, the server checks every configured stage (checks.py) and loads the engine and the
recognizer; if any cannot run it exits with status 2 and one line naming the stage and the fix.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING
from xml.sax.saxutils import quoteattr

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response

from orpheus_tts_plugin.runtime.affinity import pin_process

from .checks import StageUnavailable, check_stages, start_tts
from .config import AgentConfig, parse_args

if TYPE_CHECKING:  # Pipecat is imported after the checks: its import logs a banner, and a refusal is one line
    from .stages import AgentResources

EXIT_STAGE_UNAVAILABLE = 2
EXIT_INTERRUPTED = 130  # as a shell reports a program ended by Ctrl-C


def twiml(stream_url: str) -> str:
    """TwiML that connects the call's audio to our media stream WebSocket."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={quoteattr(stream_url)} /></Connect></Response>"
    )


def create_app(resources: AgentResources) -> FastAPI:
    """The FastAPI app on started resources (engine, recognizer), which it closes when the server shuts down."""
    from .bot import read_twilio_start, run_call

    config = resources.config
    calls = {"active": 0, "total": 0}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
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


async def serve(config: AgentConfig) -> None:
    """Load what every call shares, then serve calls until the server is stopped (SIGINT, SIGTERM)."""
    await start_tts(config)
    from .stages import AgentResources

    resources = AgentResources(config)
    try:
        await resources.start()
    except BaseException:
        await resources.close()
        raise
    server = uvicorn.Server(uvicorn.Config(create_app(resources), host=config.host, port=config.port, log_level="info"))
    await server.serve()


def main(argv: list[str] | None = None) -> int:
    """Check the stages, load, serve; a stage that cannot run is one line on stderr and exit status 2."""
    config = parse_args(argv)
    if config.cpus is not None:
        pin_process(config.cpus)
    try:
        check_stages(config)
        asyncio.run(serve(config))
    except StageUnavailable as exc:
        print(f"phone agent: cannot start: {exc}", file=sys.stderr)
        return EXIT_STAGE_UNAVAILABLE
    except KeyboardInterrupt:
        print("phone agent: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
