"""`orpheus-tts serve`: one engine in one process behind uvicorn; SIGTERM drains before the process exits.

Imports neither FastAPI nor uvicorn at module level, so that `orpheus-tts --help` stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..affinity import cpu_list, pin_process
from ..config import BACKENDS, DECODERS, EngineConfig, SyntheticConfig
from ..errors import missing_extra

if TYPE_CHECKING:
    import uvicorn

    from ..engine import OrpheusEngine
    from .service import Service

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags: the engine, where to listen, TLS, the drain deadline."""
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="hub id or local directory (synthetic: optional)")
    p.add_argument("--snac", default=d.snac, help="hub id or local directory")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS)
    p.add_argument("--device", default=d.device)
    p.add_argument("--model-family", default=d.model_family)
    p.add_argument("--tokenizer", default=None, help="defaults to --model")
    p.add_argument("--decoder", default=d.decoder, choices=DECODERS)
    p.add_argument("--max-streams", type=int, default=d.max_streams, help="concurrent streams admitted")
    p.add_argument("--max-batch-size", type=int, default=None, help="rows per backend step (default max streams)")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s, help="longest wait for a first token (s)")
    p.add_argument("--budget-per-char", type=float, default=d.token_budget_per_char, help="token budget per character")
    p.add_argument("--budget-base", type=int, default=d.token_budget_base, help="token budget base")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder step")
    p.add_argument("--token-rate", type=float, default=0.0, help="synthetic backend: tokens/s per stream (0: flat out)")
    p.add_argument(
        "--frames-per-token", type=float, default=SyntheticConfig().frames_per_prompt_token,
        help="synthetic backend: frames per prompt token (sets utterance length)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8880)
    p.add_argument("--uds", default=None, help="listen on this Unix socket instead of host:port")
    p.add_argument("--ssl-certfile", default=None, help="serve TLS (wss://, https://) with this certificate")
    p.add_argument("--ssl-keyfile", default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds open streams may take to end")
    p.add_argument(
        "--cpus", type=cpu_list, default=None, metavar="LIST",
        help="run the server on these CPUs only, e.g. 3 or 0-3,6 (taskset's list): its threads share one "
        "interpreter lock, and on one CPU its hand-offs are cheap (docs/serving.md)",
    )  # fmt: skip
    p.add_argument("--log-level", default="warning")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the `serve` flags describe."""
    return EngineConfig(
        model=args.model or None,  # --model "": none (the synthetic backend then tokenises bytes)
        snac=args.snac,
        backend=args.backend,
        device=args.device,
        model_family=args.model_family,
        tokenizer=args.tokenizer,
        decoder=args.decoder,
        max_streams=args.max_streams,
        max_batch_size=args.max_batch_size,
        queue_timeout_s=args.queue_timeout,
        token_budget_per_char=args.budget_per_char,
        token_budget_base=args.budget_base,
        compile=args.compile,
        synthetic=SyntheticConfig(tokens_per_second=args.token_rate, frames_per_prompt_token=args.frames_per_token),
    )


def _uvicorn() -> Any:
    try:
        import uvicorn
    except ImportError as exc:
        raise missing_extra("server", "orpheus-tts serve", exc) from None
    return uvicorn


def uvicorn_config(app: Any, **options: Any) -> uvicorn.Config:
    """uvicorn settings for a latency-bound audio server (no per-message deflate on PCM, a short grace
    period after our own drain); `options` go to uvicorn.Config (host, port, uds, ssl_*, log_level)."""
    uvicorn = _uvicorn()
    options.setdefault("log_level", "warning")
    return uvicorn.Config(app, ws_per_message_deflate=False, timeout_graceful_shutdown=2, lifespan="on", **options)


def draining_server(config: uvicorn.Config, service: Service, drain_timeout_s: float) -> uvicorn.Server:
    """A uvicorn.Server whose first SIGTERM/SIGINT drains (`Service.drain`) before exiting; a second exits at once."""
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
            """Signal handler (main thread): the first signal drains, a second one exits now."""
            if self._draining:
                super().handle_exit(sig, frame)
                self.force_exit = self.force_exit or sig == signal.SIGTERM
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
                log.error("the engine failed to start: %s", exc)
                print(f"orpheus-tts serve: error: the engine failed to start: {exc}", file=sys.stderr)
                self.exit_code = 2
                self.should_exit = True

    return DrainingServer()


def serve_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts serve` until SIGTERM/SIGINT, then drain and exit."""
    if args.cpus is not None:  # before torch loads, so that its thread pool is sized for these CPUs
        pin_process(args.cpus)
    from ..engine import OrpheusEngine
    from .app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = OrpheusEngine(engine_config(args))
    app = create_app(engine)
    config = uvicorn_config(
        app,
        host=args.host,
        port=args.port,
        uds=args.uds,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level=args.log_level,
    )
    server = draining_server(config, app.state.service, args.drain_timeout)
    where = args.uds or f"{args.host}:{args.port}"
    pinned = f" on CPUs {','.join(map(str, sorted(args.cpus)))}" if args.cpus is not None else ""
    print(f"orpheus-tts serve: listening on {where}{pinned}", file=sys.stderr, flush=True)
    server.run()
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
    engine: OrpheusEngine, *, uds: str | None = None, own_engine: bool = True, drain_timeout_s: float = 30.0
) -> Iterator[ServerThread]:
    """Serve `engine` on a free loopback port (or on `uds`) from a thread; stopped (not drained) on exit."""
    from .app import create_app

    app = create_app(engine, own_engine=own_engine)
    sockets: list[socket.socket] = []
    if uds is None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        host, port = sock.getsockname()[:2]
        url, http_url = f"ws://{host}:{port}", f"http://{host}:{port}"
    else:
        url, http_url = f"unix:{uds}", ""
    server = draining_server(uvicorn_config(app, uds=uds), app.state.service, drain_timeout_s)
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
