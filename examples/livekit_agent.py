"""A LiveKit voice agent that speaks with Orpheus; every call this worker serves shares one engine (one GPU).

The worker runs each job in a thread of its own process (thread job executor), so all jobs reach the
same `OrpheusEngine`, and it reports the engine's load to the LiveKit server, which sends new calls
to less busy workers. With ORPHEUS_SERVER_URL set (an `orpheus-tts serve` on this machine or another),
the worker keeps LiveKit's default process per job instead, every job reaching that one engine server
and the server's load reported. STT and LLM go through LiveKit Inference; VAD runs locally.

    pip install "orpheus-tts-plugin[livekit]"
    python examples/livekit_agent.py download-files     # Orpheus + SNAC weights into the HF cache
    export LIVEKIT_URL=wss://... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=...
    python examples/livekit_agent.py start              # or: python examples/livekit_agent.py dev

Settings (environment): ORPHEUS_MODEL (hub id or local dir), ORPHEUS_BACKEND (hf | trtllm | vllm |
remote), ORPHEUS_SERVER_URL (ws://HOST:8880 of `orpheus-tts serve`, or several such URLs separated by
commas, each call's speech then going to the least-loaded; then no model loads here),
ORPHEUS_VOICE, ORPHEUS_MAX_CALLS (calls one worker may hold), ORPHEUS_LOAD_THRESHOLD,
ORPHEUS_FALLBACK_TTS (a LiveKit Inference TTS, e.g. cartesia/sonic-3, that speaks while Orpheus is
stalled, full, loading or failed: docs/livekit.md, "Timeouts, retries and failover").
"""

from __future__ import annotations

import os

from livekit.agents import (
    Agent,
    AgentServer,
    AgentSession,
    APIConnectOptions,
    JobContext,
    JobProcess,
    cli,
    inference,
    tts,
)
from livekit.agents.voice.agent_session import SessionConnectOptions

from orpheus_tts_plugin import EngineConfig
from orpheus_tts_plugin import livekit as orpheus

ENGINE = EngineConfig(
    model=os.environ.get("ORPHEUS_MODEL", EngineConfig.model),
    backend=os.environ.get("ORPHEUS_BACKEND", EngineConfig.backend),
)
SERVER_URL = os.environ.get("ORPHEUS_SERVER_URL")
VOICE = os.environ.get("ORPHEUS_VOICE", "tara")
FALLBACK_TTS = os.environ.get("ORPHEUS_FALLBACK_TTS")
# A stalled engine is noticed 2 s after the request or the last chunk (healthy first audio on a GPU: ~0.2 s).
CONN_OPTIONS = SessionConnectOptions(tts_conn_options=APIConnectOptions(timeout=2.0))
INSTRUCTIONS = (
    "You are a friendly voice assistant. Answer in short, plain spoken sentences without markdown or emojis. "
    "You may use the tags <laugh>, <chuckle> or <sigh> where a person would."
)


def engine() -> orpheus.SpeechEngine:
    """This process's engine: the shared in-process one, or its connection to the engine server."""
    return orpheus.remote_engine(SERVER_URL) if SERVER_URL else orpheus.prewarm_engine(ENGINE)


def prewarm(proc: JobProcess) -> None:
    """Runs before each job (in its thread, or its process): start loading or connecting, and load a VAD."""
    engine()  # returns at once; the model loads (or the connection opens) in the background
    proc.userdata["vad"] = inference.VAD()


server = AgentServer(
    **orpheus.server_options(
        None if SERVER_URL else ENGINE,
        server_url=SERVER_URL,
        max_jobs=int(os.environ.get("ORPHEUS_MAX_CALLS", "64")),
        load_threshold=float(os.environ.get("ORPHEUS_LOAD_THRESHOLD", "0.8")),
    ),
    setup_fnc=prewarm,
)


async def voice() -> tts.TTS:
    """Orpheus, failing over at once to FALLBACK_TTS if set; without one, wait for the model to load first."""
    speaker = orpheus.TTS(engine=engine(), voice=VOICE)
    if FALLBACK_TTS:  # no retries of the same TTS: fail over on the first timeout or error
        return tts.FallbackAdapter([speaker, inference.TTS(FALLBACK_TTS)], max_retry_per_tts=0)
    await speaker.engine.start()  # nothing else could speak meanwhile (the worker's first call only)
    return speaker


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    """One call: STT → LLM → Orpheus, in this job's own event loop, on the worker's one engine."""
    session = AgentSession(
        stt=inference.STT("deepgram/nova-3"),
        llm=inference.LLM("openai/gpt-4.1-mini"),
        vad=ctx.proc.userdata["vad"],
        tts=await voice(),
        conn_options=CONN_OPTIONS,
    )
    await session.start(agent=Agent(instructions=INSTRUCTIONS), room=ctx.room)
    session.generate_reply(instructions="Greet the user and offer your help.")


if __name__ == "__main__":
    cli.run_app(server)
