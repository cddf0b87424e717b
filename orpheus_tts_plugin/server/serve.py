"""`orpheus-tts serve`: one engine in one process behind uvicorn; SIGTERM drains before the process exits,
Ctrl-C (SIGINT) stops it now with status 130.

It binds its port and checks its flags before anything loads, so that a port in use or a wrong path is one line
at once. Imports neither FastAPI nor uvicorn at module level, so that `orpheus-tts --help` stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..config import BACKENDS, DECODERS, EngineConfig, SyntheticConfig
from ..errors import missing_extra
from ..interrupt import end_interrupted
from ..preflight import check_before_load
from ..runtime.affinity import cpu_list, pin_process
from .policy import KEYS_ENV, Policy, load_keys
from .voice_store import DirectoryVoiceStore, VoiceStore

if TYPE_CHECKING:
    import uvicorn

    from ..engine.core import OrpheusEngine
    from .service import Service

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags: the engine, where to listen, TLS, the drain deadline."""
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="hub id or local directory (synthetic: optional)")
    p.add_argument("--snac", default=d.snac, help="hub id or local directory")
    p.add_argument(
        "--backend", default=d.backend, choices=BACKENDS, help="what generates the tokens (docs/backends.md)"
    )
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--model-family", default=d.model_family, help="token ids and voices (docs/voices.md)")
    p.add_argument("--tokenizer", default=None, help="defaults to --model")
    p.add_argument("--completions-url", default=None, help="openai-completions: the server's URL")
    p.add_argument(
        "--decoder", default=d.decoder, choices=DECODERS, help="null: silence on SNAC's schedule (benchmarks)"
    )
    p.add_argument("--max-streams", type=int, default=d.max_streams, help="concurrent streams admitted")
    p.add_argument("--max-batch-size", type=int, default=None, help="rows per backend step (default max streams)")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s, help="longest wait for a first token (s)")
    p.add_argument("--budget-per-char", type=float, default=d.token_budget_per_char, help="token budget per character")
    p.add_argument(
        "--budget-base",
        type=int,
        default=d.token_budget_base,
        help="an utterance's token budget besides --budget-per-char",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder step")
    p.add_argument("--token-rate", type=float, default=0.0, help="synthetic backend: tokens/s per stream (0: flat out)")
    p.add_argument(
        "--frames-per-token", type=float, default=SyntheticConfig().frames_per_prompt_token,
        help="synthetic backend: frames per prompt token (sets utterance length)",
    )  # fmt: skip
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="a LoRA adapter (PEFT folder or hub id) served beside the model; repeatable (docs/voices.md)",
    )  # fmt: skip
    p.add_argument(
        "--adapter-voice", action="append", default=[], metavar="VOICE=NAME",
        help="a fine-tuned voice: VOICE is spoken by adapter NAME; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--voice-alias", action="append", default=[], metavar="NAME=VOICE",
        help="the OpenAI route speaks voice NAME (e.g. alloy) with the model's VOICE; repeatable; overrides the "
        "default table (docs/serving.md)",
    )  # fmt: skip
    p.add_argument(
        "--voices-dir", default=None, metavar="DIR",
        help="keep cloned voices in this folder, shared by every server given it: a voice added on one is spoken "
        "by all (default: each server's own memory; on Ray Serve, the cluster's registry; docs/serving.md)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; set a key)")
    p.add_argument("--port", type=int, default=8880, help="TCP port to listen on")
    p.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    p.add_argument("--ssl-certfile", default=None, help="serve TLS (wss://, https://) with this certificate")
    p.add_argument("--ssl-keyfile", default=None, help="the private key of --ssl-certfile")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds open streams may take to end")
    limits = Policy()
    g = p.add_argument_group("keys and limits (docs/serving.md, Deploying)")
    g.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help=f"a key clients must send (Authorization: Bearer KEY); repeatable; also ${KEYS_ENV} (comma-separated)",
    )  # fmt: skip
    g.add_argument("--api-key-file", default=None, metavar="PATH", help="keys, one per line (# comments)")
    g.add_argument("--metrics-key", default=None, help="/metrics needs this key (default: /metrics is open)")
    g.add_argument("--max-chars", type=int, default=limits.max_chars, help="characters of text per request")
    g.add_argument(
        "--max-message-bytes", type=int, default=limits.max_message_bytes,
        help="bytes of a WebSocket message or an HTTP body",
    )  # fmt: skip
    g.add_argument("--max-json-depth", type=int, default=limits.max_json_depth, help="nesting of a JSON request")
    g.add_argument(
        "--streams-per-connection", type=int, default=None, metavar="N",
        help="open streams one WebSocket may hold (default: --max-streams; half of it with several keys)",
    )  # fmt: skip
    g.add_argument(
        "--streams-per-key", type=int, default=None, metavar="N",
        help="open streams one key may hold (default: --max-streams; half of it with several keys)",
    )  # fmt: skip
    g.add_argument(
        "--send-buffer", type=float, default=limits.send_buffer_s, metavar="SECONDS",
        help="audio a stream may have queued for a client that does not read, before it stops taking more",
    )  # fmt: skip
    g.add_argument(
        "--slow-consumer-timeout", type=float, default=limits.slow_consumer_timeout_s, metavar="SECONDS",
        help="a stream whose client reads none of its full buffer for this long ends with an error",
    )  # fmt: skip
    g.add_argument(
        "--auth-timeout", type=float, default=limits.auth_timeout_s,
        help="seconds a WebSocket without the key in its headers has to send its `auth` message",
    )  # fmt: skip
    g.add_argument(
        "--header-timeout", type=float, default=limits.header_timeout_s,
        help="seconds a new connection has to send its first request's headers",
    )  # fmt: skip
    p.add_argument(
        "--cpus", type=cpu_list, default=None, metavar="LIST",
        help="run the server on these CPUs only, e.g. 3 or 0-3,6 (taskset's list): its threads share one "
        "interpreter lock, and on one CPU its hand-offs are cheap (docs/serving.md)",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's and the engine's log level",
    )  # fmt: skip


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the `serve` flags describe."""
    return EngineConfig(
        model=args.model or None,  # --model "": none (the synthetic backend then tokenises bytes)
        snac=args.snac,
        backend=args.backend,
        device=args.device,
        model_family=args.model_family,
        tokenizer=args.tokenizer,
        completions_url=args.completions_url,
        decoder=args.decoder,
        max_streams=args.max_streams,
        max_batch_size=args.max_batch_size,
        queue_timeout_s=args.queue_timeout,
        token_budget_per_char=args.budget_per_char,
        token_budget_base=args.budget_base,
        max_text_chars=args.max_chars,  # the engine takes what the server lets in (Policy.max_chars)
        compile=args.compile,
        synthetic=SyntheticConfig(tokens_per_second=args.token_rate, frames_per_prompt_token=args.frames_per_token),
        adapters=_pairs("--adapter", getattr(args, "adapter", [])),
        adapter_voices=_pairs("--adapter-voice", getattr(args, "adapter_voice", [])),
    )


def voice_store(args: argparse.Namespace) -> VoiceStore | None:
    """The store of `--voices-dir` (ValueError in one line if the folder cannot be used), or None: the server's
    memory."""
    return None if args.voices_dir is None else DirectoryVoiceStore(args.voices_dir)


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    """KEY=VALUE flags as a dict; ValueError naming the flag for one without "=" or a key given twice."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        if key in out:
            raise ValueError(f"{flag} names {key!r} twice")
        out[key] = value
    return out


def policy(args: argparse.Namespace) -> Policy:
    """The Policy that the `serve` flags (and ORPHEUS_API_KEYS) describe; ValueError in one line."""
    return Policy(
        api_keys=load_keys(args.api_key, args.api_key_file),
        metrics_key=args.metrics_key,
        max_chars=args.max_chars,
        max_message_bytes=args.max_message_bytes,
        max_json_depth=args.max_json_depth,
        streams_per_connection=args.streams_per_connection,
        streams_per_key=args.streams_per_key,
        send_buffer_s=args.send_buffer,
        slow_consumer_timeout_s=args.slow_consumer_timeout,
        auth_timeout_s=args.auth_timeout,
        header_timeout_s=args.header_timeout,
        voice_aliases=_pairs("--voice-alias", getattr(args, "voice_alias", [])),
    )


def _loopback(host: str) -> bool:
    """Whether `host` names only this machine (a name is resolved; one that does not resolve is not)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


class ListenError(ValueError):
    """`serve` cannot listen where it was told (a port in use, a host not of this machine); the message says what
    to change."""


def listening_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """A socket listening on host:port (or on the Unix socket `uds`), as uvicorn would bind it; ListenError in one
    line if it cannot be."""
    if uds is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):  # a socket file left behind is replaced, as asyncio does
            if stat.S_ISSOCK(os.stat(uds).st_mode):
                os.remove(uds)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(uds if uds is not None else (host, port))
        sock.listen()
        if uds is not None:
            os.chmod(uds, 0o666)
    except OSError as exc:
        sock.close()
        where = f"--uds {uds}" if uds is not None else f"{host}:{port}"
        raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}; {_listen_fix(exc, uds)}") from None
    return sock


def _listen_fix(exc: OSError, uds: str | None) -> str:
    flag = "--uds" if uds is not None else "--port"
    if exc.errno == errno.EADDRINUSE:
        return f"another process listens there: stop it, or pick another {flag}"
    if exc.errno == errno.EACCES:
        return f"this user may not listen there (ports below 1024 need privileges): pick another {flag}"
    return "check --host" if uds is None else "check the --uds path"


def _uvicorn() -> Any:
    try:
        import uvicorn
    except ImportError as exc:
        raise missing_extra("server", "orpheus-tts serve", exc) from None
    return uvicorn


def uvicorn_config(app: Any, policy: Policy | None = None, **options: Any) -> uvicorn.Config:
    """uvicorn settings for a latency-bound audio server (no per-message deflate on PCM, a short grace
    period after our own drain) under `policy` (message size, header timeout); `options` go to
    uvicorn.Config (host, port, uds, ssl_*, log_level)."""
    uvicorn = _uvicorn()
    policy = policy or Policy()
    options.setdefault("log_level", "warning")
    return uvicorn.Config(
        app,
        ws_per_message_deflate=False,
        ws_max_size=policy.max_message_bytes,
        http=header_timeout_protocol(policy.header_timeout_s),
        timeout_graceful_shutdown=2,
        lifespan="on",
        **options,
    )


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks) that closes a connection whose first
    request's headers have not arrived within `timeout_s`: half-open and trickling sockets hold nothing.

    uvicorn itself times out only idle keep-alive connections (after a response), never a new one.
    """
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS["auto"])

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._orpheus_timer = self.loop.call_later(timeout_s, self._orpheus_no_request)

        def connection_lost(self, exc: Exception | None) -> None:
            self._orpheus_timer.cancel()
            super().connection_lost(exc)

        def _orpheus_no_request(self) -> None:
            # `cycle` is set once a request's headers are in; after a WebSocket upgrade the transport has a
            # new protocol, and the connection is the WebSocket's (its pings time it out).
            if self.cycle is None and self.transport.get_protocol() is self and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def draining_server(config: uvicorn.Config, service: Service, drain_timeout_s: float) -> uvicorn.Server:
    """A uvicorn.Server whose first SIGTERM drains (`Service.drain`) before exiting, a second exits at once; SIGINT
    (Ctrl-C) stops it without a drain, or ends the process at once while the model loads."""
    uvicorn = _uvicorn()

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server with a drain in front of its shutdown; `begin_drain()` starts it from any thread."""

        def __init__(self) -> None:
            super().__init__(config)
            self.exit_code = 0
            self.drained: bool | None = None  # set on the server loop when the drain ends
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False  # set in the signal handler or begin_drain(), read on the server loop
            self._drain_task: asyncio.Task[None] | None = None  # server loop only

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            watch = asyncio.create_task(self._watch_start())
            try:
                await super().serve(sockets)
            finally:
                watch.cancel()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """Signal handler (main thread): the first SIGTERM drains, a second one exits now; SIGINT stops now."""
            if sig == signal.SIGINT:
                if service.engine.health()["status"] != "ok":  # a load cannot be stopped, and a close waits for it
                    end_interrupted("serve")
                super().handle_exit(sig, frame)  # uvicorn raises SIGINT again once it has stopped: exit status 130
            elif self._draining:
                super().handle_exit(sig, frame)
                self.force_exit = True
            else:
                self.begin_drain()

        def begin_drain(self) -> None:
            self._draining = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if self._drain_task is None:
                self._drain_task = asyncio.create_task(self._drain(), name="orpheus-drain")

        async def _drain(self) -> None:
            log.warning("draining: no new streams; open streams have %g s to finish", drain_timeout_s)
            self.drained = await service.drain(drain_timeout_s)
            self.should_exit = True

        async def _watch_start(self) -> None:
            """A model that cannot load makes the server exit (status 2) instead of answering 503 forever."""
            try:
                await service.engine.start()
            except Exception as exc:  # noqa: BLE001 - any load failure ends the server
                print(f"orpheus-tts serve: error: the engine failed to start: {exc}", file=sys.stderr, flush=True)
                self.exit_code = 2
                self.should_exit = True

    return DrainingServer()


def serve_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts serve` until SIGTERM (drain, then exit) or SIGINT (exit now, status 130)."""
    rules = policy(args)
    store = voice_store(args)
    _uvicorn()  # first: a missing server extra is the one line to see, whatever else is wrong
    from .app import create_app

    if args.cpus is not None:  # before torch loads, so that its thread pool is sized for these CPUs
        pin_process(args.cpus)
    sock = listening_socket(args.host, args.port, args.uds)
    wanted = engine_config(args)
    check_before_load(wanted)
    from ..engine.core import OrpheusEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = OrpheusEngine(wanted)
    app = create_app(engine, policy=rules, voice_store=store)
    config = uvicorn_config(
        app,
        rules,
        host=args.host,
        port=args.port,
        uds=args.uds,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level=args.log_level,
    )
    server = draining_server(config, app.state.service, args.drain_timeout)
    where = args.uds or f"{args.host}:{sock.getsockname()[1]}"  # --port 0: the port it was given
    pinned = f" on CPUs {','.join(map(str, sorted(args.cpus)))}" if args.cpus is not None else ""
    print(f"orpheus-tts serve: listening on {where}{pinned}", file=sys.stderr, flush=True)
    if args.uds is None and not rules.api_keys and not _loopback(args.host):
        print(
            f"orpheus-tts serve: warning: {args.host} is not a loopback address and no API key is set: anyone who"
            " can reach it may use this engine (--api-key, --api-key-file or $" + KEYS_ENV + ")",
            file=sys.stderr,
            flush=True,
        )
    server.run(sockets=[sock])
    return server.exit_code


@dataclass
class ServerThread:
    """A server running in a thread of this process (tests, benchmarks, embedding): its URLs and its handles."""

    url: str  # ws://… (or unix:/…) for RemoteEngine
    http_url: str  # http://… for the HTTP endpoints ("" on a Unix socket)
    server: Any  # the draining uvicorn.Server: begin_drain(), should_exit
    service: Service


@contextlib.contextmanager
def serving_in_thread(
    engine: OrpheusEngine,
    *,
    uds: str | None = None,
    own_engine: bool = True,
    drain_timeout_s: float = 30.0,
    policy: Policy | None = None,
    socket_send_buffer: int | None = None,
    port: int = 0,
    replica: str | None = None,
    voice_store: VoiceStore | None = None,
) -> Iterator[ServerThread]:
    """Serve `engine` under `policy` on a loopback port (`port`, default a free one; or on `uds`) from a thread;
    stopped (not drained) on exit. `socket_send_buffer`: SO_SNDBUF of its connections (a test's stalled client then
    fills it at once, where loopback's autotuned buffer would hold megabytes). `replica`: as `create_app`'s (the
    server then asks clients to post their streams, as behind Ray Serve's proxy); `voice_store`: as `create_app`'s."""
    from .app import create_app

    app = create_app(engine, own_engine=own_engine, policy=policy, replica=replica, voice_store=voice_store)
    sockets: list[socket.socket] = []
    if uds is None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if socket_send_buffer is not None:  # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_send_buffer)
        sock.bind(("127.0.0.1", port))
        sockets.append(sock)
        host, port = sock.getsockname()[:2]
        url, http_url = f"ws://{host}:{port}", f"http://{host}:{port}"
    else:
        url, http_url = f"unix:{uds}", ""
    server = draining_server(uvicorn_config(app, policy, uds=uds), app.state.service, drain_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets or None}, name="orpheus-serve", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread ended before it started")
        time.sleep(0.005)
    try:
        yield ServerThread(url, http_url, server, app.state.service)
    finally:
        server.should_exit = True
        thread.join(30)
