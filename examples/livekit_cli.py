"""The LiveKit example's command line: flags into the environment, checks before anything loads, then LiveKit's
current CLI (`python -m livekit.agents`, what `lk agent ...` runs; exec'd, its command line its only interface) on
the agent file, or an offline command.

`start`/`dev`/`console` hand the agent file to LiveKit's supported entry point, not the deprecated
`cli.run_app`; `download-files` fetches the engine's weights itself (LiveKit's own finds only `livekit.plugins.*`
packages); `speak` runs one simulated job on a worker with no LiveKit server. A mistake is one line, status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

from livekit.agents import AgentServer, JobContext
from livekit.protocol import models
from livekit_settings import ENV, SETTING_ERRORS, Settings

from orpheus_tts_plugin.interrupt import end_now
from orpheus_tts_plugin.weights import download_files, hub_repos, load_error, require_weights, weight_sources

PROGRAM = "livekit_agent.py"
LIVEKIT_ENV = {"url": "LIVEKIT_URL", "api_key": "LIVEKIT_API_KEY", "api_secret": "LIVEKIT_API_SECRET"}
URL_SCHEMES = ("ws", "wss", "http", "https")


def build_parser() -> argparse.ArgumentParser:
    """The commands, each taking the engine flags (before or after the command) over their ORPHEUS_* variables."""
    flags = argparse.ArgumentParser(add_help=False)
    for name, var in ENV.items():
        flags.add_argument(f"--{name.replace('_', '-')}", default=argparse.SUPPRESS, help=f"default: ${var}")
    parser = argparse.ArgumentParser(prog=PROGRAM, parents=[flags], description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, about in (("start", "run the worker against a LiveKit server"), ("dev", "start, with dev logs")):
        worker = sub.add_parser(command, parents=[flags], help=about)
        for name, var in LIVEKIT_ENV.items():
            worker.add_argument(f"--{name.replace('_', '-')}", default=argparse.SUPPRESS, help=f"default: ${var}")
    console = sub.add_parser("console", parents=[flags], help="talk to the agent (run by `lk agent console`)")
    console.add_argument("--connect-addr", help="the LiveKit CLI's console address (lk passes it)")
    sub.add_parser("download-files", parents=[flags], help="fetch the engine's weights into the Hugging Face cache")
    speak = sub.add_parser("speak", parents=[flags], help="offline: one simulated job speaks TEXT into a WAV")
    speak.add_argument("text")
    speak.add_argument("--out", required=True, help="WAV file to write")
    speak.add_argument("--timeout", type=float, default=600.0, help="seconds for the load and the speech")
    return parser


def export(args: argparse.Namespace) -> None:
    """Write the flags given into the environment, where the agent module and LiveKit's job processes read them."""
    for name, var in {**ENV, **LIVEKIT_ENV}.items():
        if name in args:
            os.environ[var] = getattr(args, name)


def require_livekit() -> None:
    """ValueError, in one line, unless the environment names a LiveKit server and its keys."""
    missing = [var for var in LIVEKIT_ENV.values() if not os.environ.get(var)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: the worker registers with a LiveKit server; export LIVEKIT_URL "
            "(wss://<project>.livekit.cloud, or ws://127.0.0.1:7880 for `livekit-server --dev`), LIVEKIT_API_KEY "
            "and LIVEKIT_API_SECRET, or pass --url/--api-key/--api-secret (`speak` runs without a server)"
        )
    url = os.environ["LIVEKIT_URL"]
    if urlparse(url).scheme not in URL_SCHEMES or not urlparse(url).netloc:
        raise ValueError(f"LIVEKIT_URL={url!r} is not a LiveKit server URL: use wss://HOST or ws://HOST:PORT")


def run_livekit(agent_file: str, args: argparse.Namespace) -> NoReturn:
    """`start`, `dev`, `console`: LiveKit's current CLI on the agent file, once everything it needs is there."""
    if args.command == "console":
        if not args.connect_addr:
            raise ValueError(
                "console is driven by the LiveKit CLI: run `lk agent console examples/livekit_agent.py` (it passes "
                "--connect-addr); without it, `speak` runs a job offline"
            )
        Settings.from_env().check()
        livekit_command(["console", agent_file, "--connect-addr", args.connect_addr])
    require_livekit()
    Settings.from_env().check()
    dev = ["--dev", "--log-format", "colored", "--log-level", "DEBUG"] if args.command == "dev" else []
    livekit_command(["start", agent_file, *dev])


def livekit_command(argv: list[str]) -> NoReturn:
    """LiveKit's documented command line, `python -m livekit.agents ARGV`, in place of this process: the worker
    gets its signals and gives its exit status as if run so (the flags given are in the environment by now)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "livekit.agents", *argv])


def fetch(agent_file: str, args: argparse.Namespace) -> int:
    """`download-files`: the engine's hub weights into the Hugging Face cache; one line if the hub is out of reach."""
    settings = Settings.from_env()
    if settings.server_url:
        print("nothing to fetch here: the engine servers hold the weights (`orpheus-tts download` on them)")
        return 0
    config = settings.engine
    for what, source, kind in weight_sources(config):
        require_weights(what, source, kind)  # a wrong folder, or offline and not cached: one line with the fix
    repos = hub_repos(config)
    if not repos:
        print(f"nothing to fetch: {config.model} and {config.snac} are local directories")
        return 0
    try:
        download_files(config)
    except Exception as exc:  # the hub's own errors run to many lines
        raise load_error("the weights", ", ".join(repos), exc) from exc
    print(f"fetched {', '.join(repos)} into the Hugging Face cache")
    return 0


def speak(agent_file: str, args: argparse.Namespace) -> int:
    """`speak`: the agent's worker, unregistered (no LiveKit server), runs one job that speaks `text` into `out`."""
    Settings.from_env().check()
    import livekit_agent  # built from the environment written above

    out = Path(args.out).resolve()
    signal.signal(signal.SIGINT, lambda *_: _interrupted(args.command))  # at once, not after the worker's close
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        where = {"text": args.text, "out": str(out), "result": str(result)}
        asyncio.run(asyncio.wait_for(_one_job(livekit_agent.make_server(), where, result), args.timeout))
        record = json.loads(result.read_text())
    if "error" in record:
        raise RuntimeError(record["error"])
    print(f"spoke {record['seconds']:.2f} s of audio to {out} (one simulated LiveKit job, no LiveKit server)")
    return 0


async def _one_job(server: AgentServer, where: dict[str, str], result: Path) -> None:
    """Run `server` unregistered, hand it one simulated job speaking `where`, and wait until it wrote `result`."""
    server.rtc_session(speak_job)
    started = asyncio.Event()
    server.once("worker_started", started.set)
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    try:
        await asyncio.wait({run, asyncio.create_task(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            run.result()  # the worker ended before it started: its error
        room = models.Room(sid="SRM_speak", name="speak", metadata=json.dumps(where))
        await server.simulate_job(room.name, fake_job=True, room_info=room)
        while not result.exists():  # written by the job, in its thread or its process
            await asyncio.sleep(0.05)
    finally:
        await server.aclose()
        await run


async def speak_job(ctx: JobContext) -> None:
    """The job of `speak`: the agent's own TTS (the same engine, voice and fallback as a call's), one utterance."""
    import livekit_agent

    where = json.loads(ctx.job.room.metadata)
    try:
        voice = await livekit_agent.voice()
        audio = await voice.synthesize(where["text"]).collect()
        Path(where["out"]).write_bytes(audio.to_wav_bytes())
        record: dict[str, object] = {"seconds": audio.duration}
    except Exception as exc:  # noqa: BLE001 - any failure is reported by the command in one line, not as a traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        record = {"error": f"{type(exc).__name__}: {first}" if first else type(exc).__name__}
    Path(where["result"]).write_text(json.dumps(record))
    ctx.shutdown()


COMMANDS = {"start": run_livekit, "dev": run_livekit, "console": run_livekit, "download-files": fetch, "speak": speak}


def main(agent_file: str, argv: list[str] | None = None) -> int:
    """Run a command on `agent_file` (the agent module); a mistake is one line on stderr and status 2, Ctrl-C 130."""
    args = build_parser().parse_args(argv)
    export(args)
    started = time.monotonic()
    try:
        return COMMANDS[args.command](agent_file, args)
    except (*SETTING_ERRORS, RuntimeError, OSError, asyncio.TimeoutError) as exc:
        if isinstance(exc, asyncio.TimeoutError):
            exc = TimeoutError(f"no speech within --timeout {args.timeout:g} s ({time.monotonic() - started:.0f} s)")
        print(f"{PROGRAM} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a command's own handling (LiveKit's worker, `speak`) took over
        _interrupted(args.command)


def _interrupted(command: str) -> NoReturn:
    """Ctrl-C: one line and status 130 at once (a model load in progress can be neither stopped nor waited for)."""
    print(f"{PROGRAM} {command}: interrupted", file=sys.stderr)
    end_now()
