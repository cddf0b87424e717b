"""The phone agent server: TwiML endpoint, Twilio Media Streams WebSocket, one pipeline per call, one engine for all.

    python -m examples.pipecat_phone_agent.server --help

Endpoints: `GET|POST /twiml` (point the Twilio number's voice webhook here), `WS /ws` (the media
stream the TwiML connects), `GET /stats` (calls, capacity, load and engine counters, e.g. for load balancing),
`GET /calls/{stream_sid}/moments` (when each latency stage of the call's turns happened).

The server carries `--max-calls` calls at once (admission.py); one more is refused at once: the TwiML answer is
`<Reject reason="busy"/>` (a call told to connect holds its place, by CallSid, until its media stream starts), and a
media stream that starts while the agent is full (no place held for it) is closed with code 1013, before any pipeline
is built or engine stream opened.

Before it listens, the server checks every configured stage (checks.py) and loads the engine and the
recognizer; if any cannot run it exits with status 2 and one line naming the stage and the fix.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING
from urllib.parse import parse_qs
from xml.sax.saxutils import quoteattr

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response
from loguru import logger

from orpheus_tts_plugin.runtime.affinity import pin_process

from .admission import BUSY_CLOSE_CODE, BUSY_REASON, Admission
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


def twiml_reject() -> str:
    """TwiML that turns the call away as busy: Twilio does not answer it, and the caller hears a busy signal."""
    return '<?xml version="1.0" encoding="UTF-8"?><Response><Reject reason="busy"/></Response>'


async def call_sid_of(request: Request) -> str:
    """The CallSid of Twilio's webhook request (the form it POSTs, or the query of a GET); "" if it has none."""
    form = parse_qs((await request.body()).decode(errors="replace"))
    return form.get("CallSid", [request.query_params.get("CallSid", "")])[0]


def create_app(resources: AgentResources) -> FastAPI:
    """The FastAPI app on started resources (engine, recognizer), which it closes when the server shuts down.

    `app.state.admission` counts its calls against `config.max_calls`."""
    from .bot import read_twilio_start, run_call

    config = resources.config
    admission = Admission(config.max_calls)  # the server's event loop owns it (every endpoint runs there)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await resources.close()

    app = FastAPI(lifespan=lifespan)
    app.state.admission = admission

    @app.api_route("/twiml", methods=["GET", "POST"])
    async def answer(request: Request) -> Response:
        if not admission.hold(await call_sid_of(request)):
            return Response(twiml_reject(), media_type="application/xml")
        url = config.public_url or f"wss://{request.headers['host']}/ws"
        return Response(twiml(url), media_type="application/xml")

    @app.websocket("/ws")
    async def media_stream(websocket: WebSocket) -> None:
        await websocket.accept()
        call = await read_twilio_start(websocket)
        if not admission.try_admit(call.call_sid):
            logger.info(f"call {call.call_sid} refused: {admission.active} calls, capacity {admission.capacity}")
            await websocket.close(code=BUSY_CLOSE_CODE, reason=BUSY_REASON)
            return
        try:
            await run_call(websocket, call, resources)
        finally:
            admission.release()

    @app.get("/stats")
    async def stats() -> dict:
        return {"calls": admission.stats(), "engine": resources.engine.stats()}

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
