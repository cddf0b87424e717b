"""A LiveKit voice agent that speaks with Orpheus; every call this worker serves shares one engine (one GPU).

The worker runs each job in a thread of its own process (thread job executor), so all jobs reach the
same `OrpheusEngine`, and it reports the engine's load to the LiveKit server, which sends new calls
to less busy workers. With ORPHEUS_SERVER_URL set (an `orpheus-tts serve` on this machine or another),
the worker keeps LiveKit's default process per job instead, every job reaching that one engine server
and the server's load reported. STT and LLM go through LiveKit Inference; VAD runs locally.

    pip install "orpheus-tts-plugin[livekit]"
    python examples/livekit_agent.py download-files      # Orpheus + SNAC weights into the HF cache
    python examples/livekit_agent.py speak "Hello." --out hello.wav   # offline: one job, no LiveKit server
    export LIVEKIT_URL=wss://... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=...
    python examples/livekit_agent.py start               # or: dev; or `lk agent start|dev|console` on this file

Settings: environment variables or flags (livekit_settings.ENV; `--help` lists them), checked before
anything loads; every mistake is one line and exit status 2. docs/livekit.md, "The example", says what a
real deployment needs.
"""

from __future__ import annotations

import sys

import livekit_cli
from livekit.agents import (
    Agent,
    AgentServer,
    AgentSession,
    APIConnectOptions,
    JobContext,
    JobProcess,
    TurnHandlingOptions,
    inference,
    tts,
)
from livekit.agents.voice.agent_session import SessionConnectOptions
from livekit_settings import settings_or_exit

from orpheus_tts_plugin import livekit as orpheus

if __name__ == "__main__":  # run as a script: the front door (flags, checks), which has LiveKit import this file
    sys.exit(livekit_cli.main(__file__))

SETTINGS = settings_or_exit("livekit_agent.py")  # imported by LiveKit's CLI or a job process: check it here too
# A stalled engine is noticed 2 s after the request or the last chunk (healthy first audio on a GPU: ~0.2 s).
CONN_OPTIONS = SessionConnectOptions(tts_conn_options=APIConnectOptions(timeout=2.0))
# Speak before the turn is confirmed: on each final transcript LiveKit runs the LLM and Orpheus ahead of the end of
# the turn, plays the audio at once when the turn ends, and discards it (the engine stream aborted) if the caller
# goes on. Cost: the engine's work for each discarded reply (docs/livekit.md, "Preemptive generation").
TURN_HANDLING: TurnHandlingOptions = {"preemptive_generation": {"preemptive_tts": True}}
INSTRUCTIONS = (
    "You are a friendly voice assistant. Answer in short, plain spoken sentences without markdown or emojis. "
    "You may use the tags <laugh>, <chuckle> or <sigh> where a person would."
)


def engine() -> orpheus.SpeechEngine:
    """This process's engine: the shared in-process one, or its connection to the engine server(s)."""
    if SETTINGS.server_url:
        return orpheus.remote_engine(SETTINGS.server_url)
    return orpheus.prewarm_engine(SETTINGS.engine)


def prewarm(proc: JobProcess) -> None:
    """Runs before each job (in its thread, or its process): start loading or connecting, and load a VAD."""
    engine()  # returns at once; the model loads (or the connection opens) in the background
    proc.userdata["vad"] = inference.VAD()


def make_server() -> AgentServer:
    """A worker for this example's engine (thread executor in process, process executor with a server URL)."""
    return AgentServer(
        **orpheus.server_options(
            None if SETTINGS.server_url else SETTINGS.engine,
            server_url=SETTINGS.server_url,
            max_jobs=SETTINGS.max_calls,
            load_threshold=SETTINGS.load_threshold,
        ),
        setup_fnc=prewarm,
    )


async def voice() -> tts.TTS:
    """Orpheus, failing over at once to the fallback TTS if set; without one, wait for the model to load first."""
    speaker = orpheus.TTS(engine=engine(), voice=SETTINGS.voice)
    if SETTINGS.fallback_tts:  # no retries of the same TTS: fail over on the first timeout or error
        return tts.FallbackAdapter([speaker, inference.TTS(SETTINGS.fallback_tts)], max_retry_per_tts=0)
    await speaker.engine.start()  # nothing else could speak meanwhile (the worker's first call only)
    return speaker


server = make_server()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    """One call: STT → LLM → Orpheus, in this job's own event loop, on the worker's one engine."""
    session = AgentSession(
        stt=inference.STT("deepgram/nova-3"),
        llm=inference.LLM("openai/gpt-4.1-mini"),
        vad=ctx.proc.userdata["vad"],
        tts=await voice(),
        conn_options=CONN_OPTIONS,
        turn_handling=TURN_HANDLING,
    )
    await session.start(agent=Agent(instructions=INSTRUCTIONS), room=ctx.room)
    session.generate_reply(instructions="Greet the user and offer your help.")
