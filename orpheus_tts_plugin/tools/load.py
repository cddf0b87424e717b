"""`orpheus-tts load`: drive an `orpheus-tts serve` endpoint as production clients do; report what callers heard.

A pool of P processes, each with one event loop and one reused WebSocket, offers concurrent streaming
requests of the bench utterances under constant traffic (N callers, each starting its next utterance
when the last ends) or variable traffic (Poisson arrivals offering N streams on average), with a
simulated player per utterance. Per point: TTFB p50/p95/p99, underruns, RTF, rejections, and host CPU
per stream (the workers' CPU seconds plus those the server reports for itself). `--fresh-connection`
runs, in the same run and at the same load, the anti-pattern of a new connection per request;
`--serve ARGS` starts the server for the run and `--in-process` adds the same load on an in-process
engine built from those ARGS, so that the server's overhead is read off one table and one plot.
Given several servers (`URL,URL,…`), each process reaches them all through one RemoteEngine (which
sends each stream to the least-loaded one), and the servers' CPU seconds are added up.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import shlex
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .bench.engine import BenchOptions, _progress, constant_traffic, variable_traffic
from .bench.figures import Utterance, capacity, report, summarize
from .bench.utterances import UTTERANCES
from .loopback import free_port

if TYPE_CHECKING:
    from ..client.connection import Connection
    from ..engine.core import OrpheusEngine
    from ..types import AudioChunk

SCHEMES = ("reuse", "fresh", "in-process")
START_MARGIN_S = 1.0  # workers connect first, then all start together this long after the point is handed out


@dataclass(frozen=True)
class LoadOptions:
    """One `orpheus-tts load` run."""

    url: str | None = None  # ws://…, wss://… or unix:/…, or several joined by commas; None: started from `serve`
    procs: int = 1
    concurrency: tuple[int, ...] = (1, 4, 16)
    duration_s: float = 15.0
    drain_s: float | None = None  # default: duration_s
    ramp_s: float = 1.0
    traffic: tuple[str, ...] = ("constant",)
    fresh_connection: bool = False
    in_process: bool = False
    serve: str | None = None  # `orpheus-tts serve` flags: start that server for the run
    cafile: str | None = None  # wss: trust this certificate (default: the server's own, when started here)
    api_key: str | None = None  # the server's key (default: $ORPHEUS_API_KEY, or `serve`'s first --api-key)
    ttfb_sla_ms: float = 250.0
    budget_per_char: float = 6.0  # the server's token budget: sizes variable traffic (see bench engine)
    budget_base: int = 0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.url is None) == (self.serve is None):
            raise ValueError("give either a URL or --serve ARGS")
        if self.in_process and self.serve is None:
            raise ValueError("--in-process needs --serve ARGS (the engine to build in process)")
        if self.procs < 1 or not self.concurrency or min(self.concurrency) < 1 or self.duration_s <= 0:
            raise ValueError("procs and concurrency must be >= 1 and the duration > 0")
        BenchOptions(traffic=self.traffic)  # checks the traffic names

    @property
    def schemes(self) -> tuple[str, ...]:
        return ("reuse",) + ("fresh",) * self.fresh_connection + ("in-process",) * self.in_process

    def levels(self, traffic: str) -> list[tuple[float, float | None]]:
        """(offered concurrency, arrivals per second or None) per point, as `bench engine` sizes them."""
        bench = BenchOptions(
            traffic=self.traffic,
            streams=self.concurrency,
            budget_per_char=self.budget_per_char,
            budget_base=self.budget_base,
        )
        return bench.levels(traffic)


@dataclass(frozen=True)
class Job:
    """One worker's share of one point."""

    url: str | None  # the server, or the servers joined by commas; None for the in-process scheme
    serve_flags: str | None  # the in-process scheme: the engine these `serve` flags describe
    cafile: str | None
    scheme: str
    traffic: str
    streams: int  # constant traffic: callers in this worker
    rate: float  # variable traffic: arrivals per second in this worker
    duration_s: float
    drain_s: float
    ramp_s: float
    seed: int
    start_at: float  # time.monotonic() at which every worker starts


@dataclass
class Share:
    """What one worker measured."""

    records: list[Utterance]
    cpu_s: float
    started: float
    ended: float
    tokens: int = 0  # in-process only (a server reports its own)


# ---------------------------------------------------------------------------------------------- clients
def _ssl_context(cafile: str | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=cafile) if cafile else None


class _Reused:
    """`synthesize(text)` over the worker's one connection (the production pattern)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def synthesize(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        from ..wire.protocol import Start

        return self.conn.stream(Start(text))

    async def aclose(self) -> None:
        await self.conn.aclose()


class _Fresh:
    """`synthesize(text)` on a new connection each time (the anti-pattern `--fresh-connection` measures); with
    several servers, to each in turn."""

    def __init__(self, url: str, cafile: str | None):
        self.urls, self.ssl = _urls(url), _ssl_context(cafile)
        self.turn = 0

    async def synthesize(self, text: str) -> AsyncGenerator[AudioChunk, None]:
        from ..client.connection import Connection
        from ..wire.protocol import Start

        url = self.urls[self.turn % len(self.urls)]
        self.turn += 1
        conn = await Connection.open(url, ssl=self.ssl)
        try:
            async for chunk in conn.stream(Start(text)):
                yield chunk
        finally:
            await conn.aclose()

    async def aclose(self) -> None:
        pass


_ENGINE: OrpheusEngine | None = None  # the in-process scheme's engine: one per worker process, kept across points


async def _in_process_engine(serve_flags: str) -> OrpheusEngine:
    """This worker's engine, started and warmed by one utterance on first use (as the server is before a run),
    on the server's `--cpus` if it has them: the two schemes then differ by the socket alone."""
    global _ENGINE
    if _ENGINE is None:
        from ..engine.core import OrpheusEngine
        from ..runtime.affinity import pin_process
        from ..server.serve import engine_config

        flags = _serve_parser().parse_args(shlex.split(serve_flags))
        if flags.cpus is not None:
            pin_process(flags.cpus)
        _ENGINE = OrpheusEngine(engine_config(flags))
        await _warm(_ENGINE)
    return _ENGINE


async def _warm(client: Any) -> None:
    """Speak one utterance: first-call costs (loading, the decoder's first run) stay out of the figures."""
    if hasattr(client, "start"):
        await client.start()
    async for _ in client.synthesize(UTTERANCES[0]):
        pass


async def _reused(url: str, cafile: str | None) -> Any:
    """The worker's client of the production pattern: one connection, or a RemoteEngine over several servers
    (connected to each before the point starts)."""
    from ..client.connection import Connection
    from ..client.remote_engine import RemoteEngine

    if len(_urls(url)) == 1:
        return _Reused(await Connection.open(url, ssl=_ssl_context(cafile)))
    engine = RemoteEngine(url, ssl=_ssl_context(cafile))
    await engine.start(every_server=True)
    return engine


def _urls(url: str) -> tuple[str, ...]:
    from ..client.upstream import server_urls

    return server_urls(url)


async def _drive(job: Job) -> Share:
    """One worker's traffic for one point, on this process's one loop."""
    if job.scheme == "in-process":
        client: Any = await _in_process_engine(job.serve_flags)
        before = client.stats().get("tokens", 0)
    elif job.scheme == "fresh":
        client = _Fresh(job.url, job.cafile)
    else:
        client = await _reused(job.url, job.cafile)
    await asyncio.sleep(max(0.0, job.start_at - time.monotonic()))
    started, cpu = time.monotonic(), time.process_time()
    if job.traffic == "constant":
        records = await constant_traffic(client, job.streams, job.duration_s, job.drain_s, job.ramp_s)
    else:
        records = await variable_traffic(client, job.rate, job.duration_s, job.drain_s, job.seed)
    share = Share(records, time.process_time() - cpu, started, time.monotonic())
    if job.scheme == "in-process":
        share.tokens = client.stats().get("tokens", 0) - before
    else:
        await client.aclose()
    return share


def _work(job: Job) -> Share:
    """The pool's entry point (a fresh event loop per point)."""
    if job.streams == 0 and job.rate == 0:
        now = time.monotonic()
        return Share([], 0.0, now, now)
    return asyncio.run(_drive(job))


# ---------------------------------------------------------------------------------------------- the server
def _serve_parser() -> argparse.ArgumentParser:
    from ..server import serve

    p = argparse.ArgumentParser(prog="orpheus-tts serve", add_help=False)
    serve.add_arguments(p)
    return p


@contextlib.contextmanager
def _spawned_server(serve_flags: str) -> Iterator[tuple[str, str | None]]:
    """`orpheus-tts serve FLAGS` on a free loopback port until the block ends: (its URL, its cert file or None)."""
    flags = shlex.split(serve_flags)
    if "--uds" not in flags:  # later flags win: a free loopback port whatever the flags say
        flags += ["--host", "127.0.0.1", "--port", str(free_port())]
    parsed = _serve_parser().parse_args(flags)
    scheme = "wss" if parsed.ssl_certfile else "ws"
    url = f"unix:{parsed.uds}" if parsed.uds else f"{scheme}://127.0.0.1:{parsed.port}"
    proc = subprocess.Popen([sys.executable, "-m", "orpheus_tts_plugin.cli", "serve", *flags])
    try:
        _wait_ready(url, proc, parsed.ssl_certfile)
        yield url, parsed.ssl_certfile
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(url: str, proc: subprocess.Popen, cafile: str | None, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"orpheus-tts serve exited with status {proc.returncode}")
        with contextlib.suppress(Exception):  # not up yet, or still loading
            if asyncio.run(_server_stats(url, cafile))["ready"]:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} was not ready within {timeout_s:g} s")


def _servers_stats(url: str, cafile: str | None, warm: bool = False) -> dict[str, float]:
    """The CPU seconds and tokens of the servers of `url` (one, or several joined by commas), added up."""
    stats = [asyncio.run(_server_stats(one, cafile, warm)) for one in _urls(url)]
    return {key: sum(s.get(key, 0) for s in stats) for key in ("process_cpu_s", "tokens")}


async def _server_stats(url: str, cafile: str | None, warm: bool = False) -> dict[str, Any]:
    """The server's stats over a connection of its own (after one utterance, if `warm`)."""
    from ..client.connection import Connection

    conn = await Connection.open(url, ssl=_ssl_context(cafile))
    try:
        if warm:
            await _warm(_Reused(conn))
        return await conn.server_stats()
    finally:
        await conn.aclose()


# ---------------------------------------------------------------------------------------------- a point
def _jobs(
    opts: LoadOptions, url: str, cafile: str | None, scheme: str, traffic: str, level: float, rate: float | None
) -> list[Job]:
    """The point split across the workers (all of it in one worker for the in-process scheme)."""
    in_process = scheme == "in-process"
    procs = 1 if in_process else opts.procs
    start_at = time.monotonic() + START_MARGIN_S
    drain = opts.duration_s if opts.drain_s is None else opts.drain_s
    n = int(level)
    return [
        Job(
            url=None if in_process else url,
            serve_flags=opts.serve if in_process else None,
            cafile=cafile,
            scheme=scheme,
            traffic=traffic,
            streams=n // procs + (i < n % procs),
            rate=(rate or 0.0) / procs,
            duration_s=opts.duration_s,
            drain_s=drain,
            ramp_s=opts.ramp_s,
            seed=opts.seed + 1000 * i + int(level * 1000),
            start_at=start_at,
        )
        for i in range(procs)
    ]


def run_point(
    opts: LoadOptions,
    pools: dict[str, concurrent.futures.Executor],
    url: str,
    cafile: str | None,
    point: tuple[str, str, float, float | None],
    bar: Any = None,
) -> dict[str, Any]:
    """One (scheme, traffic, level) point: every worker's records merged into the figures of `bench engine`."""
    scheme, traffic, level, rate = point
    remote = scheme != "in-process"
    before = _servers_stats(url, cafile) if remote else None
    futures = [pools[scheme].submit(_work, job) for job in _jobs(opts, url, cafile, scheme, traffic, level, rate)]
    t0 = time.monotonic()
    while concurrent.futures.wait(futures, timeout=0.5).not_done:
        if bar is not None:
            bar.set_postfix_str(f"{time.monotonic() - t0:.0f} s", refresh=True)
    shares = [f.result() for f in futures]
    records = [r for s in shares for r in s.records]
    wall = max(s.ended for s in shares) - min(s.started for s in shares)
    client_cpu = sum(s.cpu_s for s in shares)
    if remote:
        after = _servers_stats(url, cafile)
        server_cpu = after["process_cpu_s"] - before["process_cpu_s"]
        tokens = int(after["tokens"] - before["tokens"])
    else:
        server_cpu, tokens = 0.0, sum(s.tokens for s in shares)
    out = {"traffic": traffic, "scheme": scheme, "concurrency": level, "rate_per_s": rate, "procs": len(shares)}
    out.update(summarize(records, wall, client_cpu + server_cpu, tokens, opts.ttfb_sla_ms))
    out["client_cpu_s"], out["server_cpu_s"] = client_cpu, server_cpu
    return out


# ---------------------------------------------------------------------------------------------- the run
def run(opts: LoadOptions) -> dict[str, Any]:
    """Every point of the run, the schemes of each level back to back (so machine noise hits them alike)."""
    from .bench.common import run_metadata

    meta = run_metadata()
    spawn = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_api_key(opts))
        url, cafile = opts.url, opts.cafile
        if opts.serve is not None:
            url, own_cert = stack.enter_context(_spawned_server(opts.serve))
            cafile = cafile or own_cert
        _servers_stats(url, cafile, warm=True)
        pools: dict[str, concurrent.futures.Executor] = {}
        remote_pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(opts.procs, mp_context=spawn))
        pools["reuse"] = pools["fresh"] = remote_pool
        if opts.in_process:
            pools["in-process"] = stack.enter_context(concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn))
        todo = [
            (scheme, traffic, level, rate)
            for traffic in opts.traffic
            for level, rate in opts.levels(traffic)
            for scheme in opts.schemes
        ]
        points = []
        bar = stack.enter_context(_progress(len(todo), opts.progress))
        for point in todo:
            if bar is not None:
                bar.set_description(f"{point[1]} {point[0]} N={point[2]:g}")
            points.append(run_point(opts, pools, url, cafile, point, bar))
            if bar is not None:
                bar.update()
    served = _serve_parser().parse_args(shlex.split(opts.serve)).backend if opts.serve else "remote"
    options = {**asdict(opts), "backend": f"{served} via orpheus-tts serve", "url": url}
    return {"bench": "load", "meta": meta, "options": options, "points": points, "capacity": capacity(points)}


@contextlib.contextmanager
def _api_key(opts: LoadOptions) -> Iterator[None]:
    """For the run: $ORPHEUS_API_KEY, which every connection of this process and of its workers sends, set to
    `opts.api_key` or else the first `--api-key` of `opts.serve` (unchanged if neither)."""
    from ..client.connection import API_KEY_ENV

    served = _serve_parser().parse_args(shlex.split(opts.serve)).api_key if opts.serve else []
    key = opts.api_key or (served[0] if served else None)
    before = os.environ.get(API_KEY_ENV)
    if key is not None:
        os.environ[API_KEY_ENV] = key
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = before


# ---------------------------------------------------------------------------------------------- command line
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `load` flags (nothing heavy is imported here: `orpheus-tts --help` stays light)."""
    d = LoadOptions(url="ws://unused")
    p.add_argument(
        "url", nargs="?", default=None, help="ws://HOST:PORT, wss://…, unix:/PATH, or several: URL,URL,… (or --serve)"
    )
    p.add_argument("--url", dest="url_flag", default=None, metavar="URL[,URL…]", help="the same as the URL argument")
    p.add_argument("--procs", type=int, default=d.procs, help="client processes, one connection each")
    p.add_argument("--concurrency", type=_ints, default=d.concurrency, help="concurrent streams, e.g. 1,4,16")
    p.add_argument("--duration", dest="duration_s", type=float, default=d.duration_s, help="seconds per point")
    p.add_argument("--drain", dest="drain_s", type=float, default=None, help="seconds to finish (default duration)")
    p.add_argument("--ramp", dest="ramp_s", type=float, default=d.ramp_s, help="constant: stream starts spread (s)")
    p.add_argument(
        "--traffic", type=lambda t: tuple(v for v in t.split(",") if v), default=d.traffic, help="constant,variable"
    )
    p.add_argument("--fresh-connection", action="store_true", help="also run a new connection per request")
    p.add_argument("--serve", default=None, help="start `orpheus-tts serve` with these flags for the run")
    p.add_argument("--in-process", action="store_true", help="also run the same load on an in-process engine")
    p.add_argument("--cafile", default=None, help="wss: trust this certificate")
    p.add_argument(
        "--api-key", default=None, help="the server's key (default: $ORPHEUS_API_KEY, or --serve's first --api-key)"
    )
    p.add_argument("--ttfb-sla-ms", type=float, default=d.ttfb_sla_ms, help="p95 TTFB limit for capacity")
    p.add_argument("--budget-per-char", type=float, default=d.budget_per_char, help="the server's, for variable")
    p.add_argument("--budget-base", type=int, default=d.budget_base, help="the server's, for variable")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the traffic (texts, arrivals)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", default=None, help="write the result here and PNG plots beside it")


def main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts load` from parsed flags."""
    names = set(LoadOptions.__dataclass_fields__)
    given = {k: v for k, v in vars(args).items() if k in names}
    if args.url_flag is not None:
        if args.url is not None:
            raise SystemExit("orpheus-tts load: error: give the URL once (as the argument or as --url)")
        given["url"] = args.url_flag
    result = run(LoadOptions(**given))
    report(result, args.json)
    return 0
