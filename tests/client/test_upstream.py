"""A RemoteEngine over several real servers on loopback: new streams by load, a killed, hung or draining server left.

Servers run in threads of this process (their engines hold requests at a gate, so that a stream stays open
without a sleep) or as `orpheus-tts serve` processes (killed with SIGKILL, stopped with SIGSTOP). Every test
of the engines' behaviour runs with generation faster than decoding and slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from orpheus_tts_plugin import EngineConfig, EngineError, OrpheusEngine, RemoteEngine, SyntheticConfig
from orpheus_tts_plugin.cli import main
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread
from orpheus_tts_plugin.tools.loopback import free_port
from orpheus_tts_plugin.types import AudioChunk
from tests.servers import serve_args, serve_processes, until
from tests.stubs import SPEED_IDS, SPEEDS, GatedBackend

MAX_STREAMS = 8
TEXT = "Hello there. How are you today?"
HELD = "Please hold. " + TEXT  # GatedBackend stalls its server while this request is open, until its gate opens
LONG = " ".join([TEXT] * 20)  # minutes of audio: a stream that is still speaking whenever the test acts


# ---------------------------------------------------------------------------------------------- harness
@pytest.fixture(params=list(SPEEDS.values()), ids=SPEED_IDS)
def speed(request: pytest.FixtureRequest) -> float:
    """Synthetic tokens a second a stream: 0 outruns the decoder, 300 makes it wait."""
    return request.param


@pytest.fixture
def config(synthetic_config: EngineConfig, speed: float) -> EngineConfig:
    synthetic = SyntheticConfig(tokens_per_second=speed)
    return replace(synthetic_config, max_streams=MAX_STREAMS, synthetic=synthetic, queue_timeout_s=600.0)


@dataclass
class Served:
    """A server in a thread whose engine holds `HELD` requests until `backend.gate` is set."""

    srv: ServerThread
    backend: GatedBackend

    @property
    def url(self) -> str:
        return self.srv.url

    @property
    def engine(self) -> OrpheusEngine:
        return self.srv.service.engine

    def started(self) -> int:
        return self.engine.stats().get("streams_started", 0)

    def open(self) -> int:
        return self.engine.stats()["active_streams"]

    def hold_status(self) -> None:
        """From now on, push no status: what the server says of its load stays what it said last."""
        frozen = self.srv.service.status()
        self.srv.service.status = lambda: frozen  # type: ignore[method-assign]


@contextlib.contextmanager
def servers(config: EngineConfig, n: int, **options: Any) -> Iterator[list[Served]]:
    """`n` loaded servers in threads; their gates are opened at the end, so that held streams end."""
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(n):
            backend = GatedBackend(config.synthetic, after=0)
            srv = stack.enter_context(serving_in_thread(OrpheusEngine(config, backend=backend), **options))
            out.append(Served(srv, backend))
        deadline = time.monotonic() + 120
        while not all(s.engine.ready for s in out):
            assert time.monotonic() < deadline, [s.engine.health() for s in out]
            time.sleep(0.01)
        try:
            yield out
        finally:
            for s in out:
                s.backend.gate.set()


def seen(remote: RemoteEngine, url: str) -> dict[str, Any]:
    """What `remote` knows of the server at `url`: connected, load, its open streams there, its last status."""
    return remote.stats()["servers"][url]


def settled(remote: RemoteEngine, served: list[Served]) -> bool:
    """`remote` has each server's current load (the server pushed it since its last change)."""
    return all(seen(remote, s.url)["load"] == round(s.engine.load, 4) for s in served)


async def first(stream: AsyncGenerator[AudioChunk, None]) -> AudioChunk:
    return await asyncio.wait_for(stream.__anext__(), 60)


def hold(remote: RemoteEngine, n: int, seed: int = 0) -> list[asyncio.Task[list[AudioChunk]]]:
    """`n` HELD streams, each read whole by a task of its own (cancelling the task ends the stream)."""
    return [asyncio.create_task(heard(remote.synthesize(HELD, seed=seed + i))) for i in range(n)]


async def end(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def heard(stream: AsyncGenerator[AudioChunk, None]) -> list[AudioChunk]:
    """The whole stream, which must end (with its final chunk) within the deadline."""

    async def whole() -> list[AudioChunk]:
        return [chunk async for chunk in stream]

    return await asyncio.wait_for(whole(), 60)


async def connected(urls: list[str], **options: Any) -> RemoteEngine:
    remote = RemoteEngine(urls, **options)
    await remote.start(every_server=True)
    return remote


@contextlib.contextmanager
def serve_processes_on_loopback(
    n: int, test_model_dir: Path, speed: float, tmp_path: Path
) -> Iterator[tuple[list[str], list[subprocess.Popen]]]:
    """`n` `orpheus-tts serve` processes on free loopback ports (the test model's SNAC at `speed`): urls, processes."""
    ports = [free_port() for _ in range(n)]
    args = [serve_args(test_model_dir / "snac", port, speed) for port in ports]
    with serve_processes(args, tmp_path / "serve.log") as procs:
        yield [f"ws://127.0.0.1:{port}" for port in ports], procs


# ---------------------------------------------------------------------------------------------- where streams go
async def test_a_burst_of_starts_fills_the_least_loaded_servers_evenly_before_any_status_counts_it(
    config: EngineConfig,
) -> None:
    with servers(config, 3) as served:
        a, b, c = served
        neighbour = RemoteEngine(a.url)
        remote = await connected([s.url for s in served])
        try:
            others = hold(neighbour, 3)
            await until(lambda: a.open() == 3 and settled(remote, served))
            for s in served:
                s.hold_status()  # from here the spread can come only from the client's count of what it started
            ours = hold(remote, 6)
            await until(lambda: sum(s.open() for s in served) == 9)
            assert [s.open() for s in served] == [3, 3, 3]  # by the statuses alone: 4 and 2 on b and c
            assert [seen(remote, s.url)["active_streams"] for s in served] == [0, 3, 3]
            await end([*others, *ours])
        finally:
            await neighbour.aclose()
            await remote.aclose()


async def test_a_burst_right_after_start_spreads_over_every_server(config: EngineConfig) -> None:
    with servers(config, 3) as served:
        remote = RemoteEngine([s.url for s in served])
        try:
            await remote.start()  # one server is enough to return; the others answer within its short wait
            ours = hold(remote, 12)
            await until(lambda: sum(s.open() for s in served) == 12)
            assert [s.open() for s in served] == [4, 4, 4]  # seen 6/0/6 when start() returned at the first
            await end(ours)
        finally:
            await remote.aclose()


async def test_new_streams_go_to_the_least_loaded_server(config: EngineConfig) -> None:
    with servers(config, 3) as served:
        a, b, c = served
        neighbour = RemoteEngine(a.url)  # another process's client: its load on `a` reaches us only as a's status
        remote = await connected([s.url for s in served])
        try:
            others = hold(neighbour, 4)
            await until(lambda: a.open() == 4)
            await until(lambda: seen(remote, a.url)["load"] == 0.5 and settled(remote, served))
            ours = hold(remote, 4, seed=10)
            await until(lambda: sum(s.open() for s in served) == 8)
            assert a.open() == 4  # the neighbour's only
            assert b.open() + c.open() == 4 and b.open() >= 1 and c.open() >= 1

            await end(others)  # `a` empties: now it is the least loaded
            await until(lambda: a.engine.load == 0.0 and settled(remote, served))
            before = a.started()
            late = hold(remote, 1, seed=20)
            await until(lambda: sum(s.open() for s in served) == 5)
            assert a.started() == before + 1 and seen(remote, a.url)["active_streams"] == 1
            await end([*ours, *late])
        finally:
            await neighbour.aclose()
            await remote.aclose()


async def test_equally_loaded_servers_take_new_streams_in_turn(config: EngineConfig) -> None:
    with servers(config, 3) as served:
        remote = await connected([s.url for s in served])
        try:
            before = [s.started() for s in served]
            for i in range(6):
                await until(lambda: settled(remote, served))
                chunks = await heard(remote.synthesize(TEXT, seed=i))
                assert chunks[-1].final
            assert [s.started() - b for s, b in zip(served, before)] == [2, 2, 2]
        finally:
            await remote.aclose()


# ---------------------------------------------------------------------------------------------- a server leaves
async def test_a_draining_server_gets_no_new_streams_and_its_open_stream_finishes(config: EngineConfig) -> None:
    with servers(config, 2, drain_timeout_s=120) as served:
        a, b = served
        remote = await connected([a.url, b.url])
        try:
            await until(lambda: settled(remote, served))
            (held,) = hold(remote, 1)  # idle servers, first turn: `a`
            await until(lambda: a.open() == 1)
            a.srv.server.begin_drain()
            await until(lambda: seen(remote, a.url)["status"].get("draining", False))
            assert remote.ready and remote.health() == {"status": "ok", "reason": None}
            before_a, before_b = a.started(), b.started()
            done = await asyncio.gather(*(heard(remote.synthesize(TEXT, seed=i)) for i in range(4)))
            assert all(chunks[-1].final for chunks in done)
            assert (a.started(), b.started()) == (before_a, before_b + 4)
            a.backend.gate.set()
            assert (await held)[-1].final  # the draining server's open stream runs to its end
            await until(lambda: a.srv.server.drained is True)
        finally:
            await remote.aclose()


async def drained(stream: AsyncGenerator[AudioChunk, None]) -> BaseException | None:
    """Read `stream` to its end, keeping nothing; the error that ended it, if any."""
    try:
        async for _ in stream:
            pass
    except EngineError as exc:
        return exc
    return None


async def test_a_killed_server_ends_its_streams_with_a_retryable_error_and_new_streams_go_to_the_survivors(
    test_model_dir: Path, tmp_path: Path, speed: float
) -> None:
    from orpheus_tts_plugin.livekit.tts import _api_error

    with serve_processes_on_loopback(3, test_model_dir, speed, tmp_path) as (urls, procs):
        remote = await connected(urls, connect_timeout_s=0.5, backoff_s=(0.05, 0.5))
        try:
            streams = [remote.synthesize(LONG, seed=i, max_tokens=1_000_000) for i in range(6)]
            await asyncio.gather(*(first(s) for s in streams))
            readers = [asyncio.create_task(drained(s)) for s in streams]
            counts = {url: seen(remote, url)["active_streams"] for url in urls}
            victim = max(urls, key=counts.__getitem__)  # holds 2 or more of the 6
            procs[urls.index(victim)].kill()
            killed = time.monotonic()

            await until(lambda: sum(r.done() for r in readers) == counts[victim], timeout=10)
            errors = [r.result() for r in readers if r.done()]
            assert time.monotonic() - killed < 10
            assert all(type(e) is EngineError and victim in str(e) for e in errors), errors
            assert remote.health() == {"status": "ok", "reason": None} and remote.ready
            serving = remote.health()["status"] not in ("failed", "closed")
            assert all(_api_error(e, serving=serving).retryable for e in errors)  # LiveKit retries / fails over
            assert not seen(remote, victim)["connected"]

            survivors = [url for url in urls if url != victim]
            before = [(await remote.server_stats(url))["streams_started"] for url in survivors]
            done = await asyncio.gather(*(heard(remote.synthesize(TEXT, seed=10 + i)) for i in range(4)))
            assert all(chunks[-1].final for chunks in done)
            after = [(await remote.server_stats(url))["streams_started"] for url in survivors]
            assert sum(after) - sum(before) == 4
            alive = [r for r in readers if not r.done()]
            assert len(alive) == 6 - counts[victim]  # the survivors' streams still speak

            for proc in procs:  # every server gone: the error one dead server gives
                proc.kill()
            await until(lambda: not remote.started)
            await asyncio.gather(*alive)
            assert all(isinstance(r.result(), EngineError) for r in alive)
            assert remote.health()["status"] == "starting" and remote.load == 1.0
            with pytest.raises(EngineError, match="cannot reach"):
                await first(remote.synthesize(TEXT))
        finally:
            await remote.aclose()


async def test_a_server_that_stops_answering_is_left_after_its_keepalive_and_used_again_when_back(
    test_model_dir: Path, tmp_path: Path, speed: float
) -> None:
    with serve_processes_on_loopback(2, test_model_dir, speed, tmp_path) as (urls, procs):
        remote = await connected(urls, connect_timeout_s=0.5, backoff_s=(0.05, 0.5), keepalive_s=(0.5, 2.0))
        try:
            stream = remote.synthesize(LONG, seed=1, max_tokens=1_000_000)  # idle servers, first turn: the first
            await first(stream)
            assert seen(remote, urls[0])["active_streams"] == 1
            procs[0].send_signal(signal.SIGSTOP)  # its socket stays open; it answers nothing
            try:
                error = await asyncio.wait_for(drained(stream), 10)
                assert type(error) is EngineError and "keepalive" in str(error)
                assert not seen(remote, urls[0])["connected"] and remote.ready
                done = await asyncio.gather(*(heard(remote.synthesize(TEXT, seed=i)) for i in range(3)))
                assert all(chunks[-1].final for chunks in done)
            finally:
                procs[0].send_signal(signal.SIGCONT)
            await until(lambda: seen(remote, urls[0])["connected"])  # back: reconnected by its own backoff
            assert seen(remote, urls[0])["connects"] >= 2
        finally:
            await remote.aclose()


async def test_with_every_server_down_a_stream_fails_with_the_error_one_dead_server_gives() -> None:
    urls = [f"ws://127.0.0.1:{free_port()}" for _ in range(2)]
    for given in (urls[:1], urls):
        remote = RemoteEngine(given, connect_timeout_s=0.3)
        try:
            with pytest.raises(EngineError, match="cannot reach") as refused:
                await first(remote.synthesize(TEXT))
            assert all(url in str(refused.value) for url in given)
            assert remote.health()["status"] == "starting" and remote.load == 1.0 and not remote.ready
        finally:
            await remote.aclose()


# ---------------------------------------------------------------------------------------------- naming servers
def test_a_comma_separated_string_and_a_sequence_name_the_same_servers() -> None:
    a, b = "ws://127.0.0.1:1", "ws://127.0.0.1:2"
    assert RemoteEngine(f"{a}, {b}").config.urls == RemoteEngine([a, b]).config.urls == (a, b)
    assert RemoteEngine(a).config.url == a and RemoteEngine(a).config.urls == (a,)
    assert RemoteEngine.shared(f"{a},{b}") is RemoteEngine.shared([a, b])
    with pytest.raises(ValueError, match="at least one"):
        RemoteEngine(" , ")
    with pytest.raises(ValueError, match="ftp://x"):
        RemoteEngine([a, "ftp://x"])


@pytest.mark.parametrize("speed", list(SPEEDS.values()), ids=SPEED_IDS)
def test_orpheus_tts_load_takes_a_list_of_servers_and_spreads_its_streams(
    synthetic_config: EngineConfig, tmp_path: Path, speed: float
) -> None:
    config = replace(
        synthetic_config,
        synthetic=SyntheticConfig(tokens_per_second=speed, frames_per_prompt_token=64.0),
        token_budget_per_char=2.0,
        token_budget_base=0,
    )
    engines = [OrpheusEngine(config) for _ in range(2)]
    out = tmp_path / "load.json"
    with serving_in_thread(engines[0]) as one, serving_in_thread(engines[1]) as two:
        flags = ["--procs", "1", "--concurrency", "2", "--duration", "1.5", "--drain", "20", "--budget-per-char", "2"]
        assert main(["load", "--url", f"{one.url},{two.url}", *flags, "--no-progress", "--json", str(out)]) == 0
        started = [e.stats()["streams_started"] for e in engines]
    (point,) = json.loads(out.read_text())["points"]
    assert point["utterances"] > 0 and point["incomplete"] == 0 and point["rejected"] == 0
    assert point["server_cpu_s"] > 0
    assert all(n >= 2 for n in started)  # the warm-up and some of the traffic on each
    assert sum(started) == point["utterances"] + 2


# ---------------------------------------------------------------------------------------------- lifecycle
async def test_a_cancelled_start_leaves_the_remote_engine_as_it_was(config: EngineConfig) -> None:
    nowhere = RemoteEngine(f"ws://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    try:
        waiting = asyncio.create_task(nowhere.start())
        await until(lambda: nowhere.health()["status"] == "starting")
        waiting.cancel()  # a job that ends while the client connects
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert nowhere.health()["status"] == "starting"
        with pytest.raises(EngineError, match="cannot reach"):
            await nowhere.start()  # the usual error, not the cancellation
    finally:
        await nowhere.aclose()
    with servers(config, 1) as (one,):
        remote = RemoteEngine(one.url)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(remote.start(), 0)  # a caller's own deadline, passed at once
            await remote.start()
            assert remote.health()["status"] == "ok"
            assert (await heard(remote.synthesize(TEXT)))[-1].final
        finally:
            await remote.aclose()


async def test_a_server_killed_while_idle_costs_no_stream_a_burst_right_after_all_speak(
    test_model_dir: Path, tmp_path: Path, speed: float
) -> None:
    with serve_processes_on_loopback(3, test_model_dir, speed, tmp_path) as (urls, procs):
        remote = await connected(urls, connect_timeout_s=2.0, backoff_s=(0.05, 0.5))
        try:
            # The client hears of an idle server's death only from its socket's close, which races new streams. The
            # race is made certain: the client's connection loop is held (no public hook exists for that) while the
            # server dies and the burst is handed to it, so it routes the burst before it reads the close.
            held = threading.Event()
            remote._thread.loop.call_soon_threadsafe(held.wait, 30)
            procs[1].kill()  # no stream on it
            procs[1].wait()
            burst = [asyncio.create_task(heard(remote.synthesize(TEXT, seed=i))) for i in range(12)]
            await until(lambda: remote.stats().get("streams_started", 0) == 12)
            held.set()
            done = await asyncio.gather(*burst)
            assert all(chunks[-1].final for chunks in done)
            assert remote.stats()["failovers"] == 4  # the dead server's share of the burst, each sent on once
            assert not seen(remote, urls[1])["connected"]
        finally:
            await remote.aclose()
