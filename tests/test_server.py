"""`orpheus-tts serve` in a thread on loopback, driven by RemoteEngine, raw connections, HTTP and the openai client.

Every engine-behaviour test runs twice: with generation faster than decoding (synthetic tokens flat
out) and slower (synthetic tokens paced), so that neither order of arrival hides a bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from orpheus_tts_plugin import (
    EngineConfig,
    EngineError,
    EngineOverloadedError,
    OrpheusEngine,
    RemoteEngine,
    SamplingOverrides,
    SyntheticConfig,
)
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.server import protocol
from orpheus_tts_plugin.server.connection import Connection
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread
from orpheus_tts_plugin.spec import SAMPLE_RATE

PACES = {"fast": 0.0, "paced": 400.0}  # synthetic tokens/s a stream: 0 outruns the decoder, 400 makes it wait
TEXT = "Hello there. How are you today?"
MAX_STREAMS = 8
TOLERANCE = 2  # int16 steps: the decoder's batching varies from run to run


# ---------------------------------------------------------------------------------------------- harness
@pytest.fixture(scope="module", params=list(PACES))
def config(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> EngineConfig:
    return replace(
        synthetic_config, max_streams=MAX_STREAMS, synthetic=SyntheticConfig(tokens_per_second=PACES[request.param])
    )


@contextlib.contextmanager
def serving(config: EngineConfig, **options: Any) -> Iterator[ServerThread]:
    """An engine of `config` behind a server thread, once loaded (the server's start-up loads it)."""
    engine = OrpheusEngine(config)
    with serving_in_thread(engine, **options) as srv:
        deadline = time.monotonic() + 120
        while not engine.ready:
            assert engine.health()["status"] == "starting" and time.monotonic() < deadline, engine.health()
            time.sleep(0.01)
        yield srv


@pytest.fixture(scope="module")
def served(config: EngineConfig) -> Iterator[ServerThread]:
    with serving(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def remote(served: ServerThread) -> Iterator[RemoteEngine]:
    """One RemoteEngine for the module's tests (each test runs on its own event loop)."""
    engine = RemoteEngine(served.url)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


def engine_of(srv: ServerThread) -> OrpheusEngine:
    return srv.service.engine


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def idle(srv: ServerThread) -> bool:
    stats = engine_of(srv).stats()
    return stats["active_streams"] == 0 and stats["backend"]["live_requests"] == 0


async def pcm_of(engine: Any, text: str = TEXT, **options: Any) -> np.ndarray:
    return np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(text, **options)]), dtype="<i2")


def assert_same_audio(got: np.ndarray, reference: np.ndarray) -> None:
    assert got.size == reference.size > 0
    assert np.abs(got.astype(np.int32) - reference).max() <= TOLERANCE


def http(srv: ServerThread, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, or of a POST when `body` is given."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.http_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(srv: ServerThread, name: str) -> float:
    """A /metrics sample (`name` with or without its labels: summed over the labels not given)."""
    _, text = http(srv, "/metrics")
    lines = [line for line in text.decode().splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def one_connection(srv: ServerThread, timeout: float = 20.0) -> None:
    """Wait until the server holds exactly one WebSocket (connections other tests closed may still be going)."""
    deadline = time.monotonic() + timeout
    while metric(srv, "orpheus_ws_connections") != 1:
        assert time.monotonic() < deadline, "the server does not hold exactly one connection"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------- WebSocket
async def test_many_streams_share_one_connection_and_each_gets_its_own_audio(
    served: ServerThread, remote: RemoteEngine
) -> None:
    seeds = range(MAX_STREAMS)
    one_connection(served)
    got = await asyncio.gather(*(pcm_of(remote, seed=s) for s in seeds))
    assert metric(served, "orpheus_ws_connections") == 1  # every stream went over the one socket
    references = await asyncio.gather(*(pcm_of(engine_of(served), seed=s) for s in seeds))
    for pcm, reference in zip(got, references):
        assert_same_audio(pcm, reference)
    assert len({p.tobytes() for p in got}) == len(got)  # no stream got another's frames


async def test_a_seeded_request_through_the_server_equals_the_in_process_pcm(
    served: ServerThread, remote: RemoteEngine
) -> None:
    text = "One sentence first. Then a second one, a little longer. And a third."
    chunks = [c async for c in remote.synthesize(text, voice="leo", seed=11, temperature=0.7)]
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert [c.start_sample for c in chunks] == list(np.cumsum([0] + [c.num_samples for c in chunks[:-1]]))
    assert all(c.sample_rate == SAMPLE_RATE for c in chunks)
    local = [c async for c in engine_of(served).synthesize(text, voice="leo", seed=11, temperature=0.7)]
    assert remote.sentences(text) == engine_of(served).sentences(text)
    for i in range(len(remote.sentences(text))):  # each sentence's audio, marked where it ends
        mine, theirs = ([c for c in cs if c.utterance == i] for cs in (chunks, local))
        assert [c.utterance_end for c in mine] == [False] * (len(mine) - 1) + [True]
        assert_same_audio(*(np.frombuffer(b"".join(c.pcm for c in cs), dtype="<i2") for cs in (mine, theirs)))


async def test_empty_text_yields_nothing(remote: RemoteEngine) -> None:
    assert [c async for c in remote.synthesize("   ")] == []


def test_callers_on_three_event_loops_in_three_threads_share_one_remote_engine(
    served: ServerThread, remote: RemoteEngine
) -> None:
    one_connection(served)
    results: dict[int, np.ndarray] = {}

    def caller(i: int) -> None:
        results[i] = asyncio.run(pcm_of(remote, seed=100 + i))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2]

    async def references() -> list[np.ndarray]:
        return await asyncio.gather(*(pcm_of(engine_of(served), seed=100 + i) for i in range(3)))

    for i, reference in enumerate(asyncio.run(references())):
        assert_same_audio(results[i], reference)
    assert metric(served, "orpheus_ws_connections") == 1


# ---------------------------------------------------------------------------------------------- cancellation
def endless(config: EngineConfig) -> EngineConfig:
    """Utterances that never end by themselves: a cancel or a drain always lands in the middle of generation,
    however fast the host generates (a long but finite one was over before its first audio on slow hosts)."""
    return replace(config, token_budget_base=1_000_000, synthetic=replace(config.synthetic, endless=True))


@pytest.fixture(scope="module")
def long_served(config: EngineConfig) -> Iterator[ServerThread]:
    with serving(endless(config)) as srv:
        yield srv


@pytest.mark.parametrize("how", ["break", "generator aclose", "task cancel", "RemoteEngine aclose"])
async def test_a_cancel_aborts_the_engine_request_within_one_engine_step(long_served: ServerThread, how: str) -> None:
    remote = RemoteEngine(long_served.url)
    try:
        before = engine_of(long_served).stats()["backend"].get("aborted", 0)
        first = asyncio.Event()

        async def listen() -> None:
            async for _ in remote.synthesize(TEXT, seed=5, max_tokens=1_000_000):
                first.set()
                if how == "break":
                    break  # the generator is collected here: its finally sends the cancel

        if how == "generator aclose":
            chunks = remote.synthesize(TEXT, seed=5, max_tokens=1_000_000)
            await asyncio.wait_for(chunks.__anext__(), 30)
            await chunks.aclose()
        else:
            task = asyncio.create_task(listen())
            await asyncio.wait_for(first.wait(), 30)
            if how == "task cancel":
                task.cancel()
            elif how == "RemoteEngine aclose":
                await remote.aclose()  # the socket closes: the server aborts every stream it carried
            await asyncio.gather(task, return_exceptions=True)
        await until(lambda: idle(long_served))
        backend = engine_of(long_served).stats()["backend"]
        assert backend["aborted"] == before + 1
        assert backend["max_steps_to_abort"] <= 1
    finally:
        await remote.aclose()


# ---------------------------------------------------------------------------------------------- overload and errors
async def test_twice_the_capacity_is_refused_cleanly_and_nothing_is_lost(served: ServerThread) -> None:
    remote = RemoteEngine(served.url)
    try:
        long_text = " ".join([TEXT] * 2)
        firsts = [asyncio.Event() for _ in range(MAX_STREAMS)]

        async def hold(i: int) -> np.ndarray:
            out = []
            async for chunk in remote.synthesize(long_text, seed=i):
                out.append(chunk.pcm)
                firsts[i].set()
            return np.frombuffer(b"".join(out), dtype="<i2")

        holders = [asyncio.create_task(hold(i)) for i in range(MAX_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)  # all admitted and speaking
        assert http(served, "/ready")[0] == 503  # a load balancer sends no more here
        extra = await asyncio.gather(*(pcm_of(remote, seed=50 + i) for i in range(MAX_STREAMS)), return_exceptions=True)
        assert all(isinstance(e, EngineOverloadedError) for e in extra), extra
        heard = await asyncio.gather(*holders)
        references = await asyncio.gather(*(pcm_of(engine_of(served), long_text, seed=i) for i in range(MAX_STREAMS)))
        for pcm, reference in zip(heard, references):  # every admitted stream whole
            assert_same_audio(pcm, reference)
        assert remote.stats()["streams_rejected"] == MAX_STREAMS
        await until(lambda: idle(served))
        assert_same_audio(await pcm_of(remote, seed=3), await pcm_of(engine_of(served), seed=3))  # room again
    finally:
        await remote.aclose()


async def test_voices_and_sampling_are_checked_locally_against_what_the_server_said(
    served: ServerThread, remote: RemoteEngine
) -> None:
    requests = metric(served, "orpheus_requests_total")
    assert remote.spec.voices == engine_of(served).spec.voices
    assert remote.check_options("leo", temperature=0.3)[1].temperature == 0.3
    with pytest.raises(ValueError, match="valid voices: tara"):
        remote.synthesize(TEXT, voice="alloy")
    with pytest.raises(ValueError, match="temperature"):
        remote.synthesize(TEXT, temperature=-1.0)
    with pytest.raises(TypeError, match="unknown sampling option"):
        remote.synthesize(TEXT, temprature=0.5)
    with pytest.raises(TypeError, match="text"):
        remote.synthesize(b"bytes")  # type: ignore[arg-type]
    assert metric(served, "orpheus_requests_total") == requests  # nothing reached the server


async def test_server_side_refusals_arrive_as_the_same_exception_classes(served: ServerThread) -> None:
    conn = await Connection.open(served.url)
    try:
        bad_voice = conn.stream(protocol.Start(TEXT, voice="alloy"))
        with pytest.raises(ValueError, match="valid voices"):
            await bad_voice.__anext__()
        bad_option = conn.stream(protocol.Start(TEXT, sampling=SamplingOverrides(top_p=2.0)))
        with pytest.raises(ValueError, match="top_p"):
            await bad_option.__anext__()
        assert [c async for c in conn.stream(protocol.Start(TEXT, voice="zoe"))][-1].final  # the connection goes on
    finally:
        await conn.aclose()


@pytest.mark.parametrize(
    "message, error",
    [
        ('{"type": "start", "id": 1, "text": 3}', "TypeError"),
        ('{"type": "start", "id": 1, "text": "hi", "sampling": {"temp": 1}}', "TypeError"),
        ('{"type": "start", "id": -1, "text": "hi"}', "ValueError"),
        ('{"type": "dance", "id": 1}', "ValueError"),
        ("not json", "ValueError"),
    ],
)
async def test_malformed_messages_get_an_error_and_the_connection_goes_on(
    served: ServerThread, message: str, error: str
) -> None:
    from websockets.asyncio.client import connect

    async with connect(served.url + protocol.WS_PATH, compression=None, proxy=None) as ws:
        assert protocol.decode(await ws.recv())["type"] == "hello"
        await ws.send(message)
        reply = protocol.decode(await ws.recv())
        while reply["type"] == "status":
            reply = protocol.decode(await ws.recv())
        assert reply["type"] == "error" and reply["error"] == error
        await ws.send(protocol.encode({"type": "stats", "req": 7}))
        while (reply := protocol.decode(await ws.recv()))["type"] != "stats":
            pass
        assert reply["req"] == 7 and "active_streams" in reply["stats"]


# ---------------------------------------------------------------------------------------------- HTTP
async def test_the_openai_client_streams_pcm_equal_to_the_in_process_audio(served: ServerThread) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=served.http_url + "/v1", api_key="unused")
    async with client.audio.speech.with_streaming_response.create(
        model="orpheus", voice="tara", input=TEXT, response_format="pcm", extra_body={"seed": 9}
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers.get("transfer-encoding") == "chunked"
        body = b"".join([piece async for piece in response.iter_bytes()])
    await client.close()
    assert_same_audio(np.frombuffer(body, dtype="<i2"), await pcm_of(engine_of(served), voice="tara", seed=9))


async def test_wav_is_a_header_then_the_same_pcm(served: ServerThread) -> None:
    status, body = await asyncio.to_thread(http, served, "/v1/audio/speech", {"model": "m", "input": TEXT, "seed": 2})
    assert status == 200 and body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt "
    assert int.from_bytes(body[24:28], "little") == SAMPLE_RATE
    assert_same_audio(np.frombuffer(body[44:], dtype="<i2"), await pcm_of(engine_of(served), seed=2))


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"model": "m", "input": TEXT, "voice": "alloy"}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "response_format": "mp3"}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "temperature": "hot"}, 400, "TypeError"),
        ({"model": "m", "input": TEXT, "pitch": 2}, 400, "TypeError"),
        ({"input": TEXT}, 400, "TypeError"),
    ],
)
def test_bad_http_requests_are_refused_with_400_naming_the_field(
    served: ServerThread, body: dict, status: int, code: str
) -> None:
    got, raw = http(served, "/v1/audio/speech", body)
    assert got == status and json.loads(raw)["error"]["code"] == code


async def test_closing_the_http_response_aborts_the_engine_request(long_served: ServerThread) -> None:
    from openai import AsyncOpenAI

    before = engine_of(long_served).stats()["backend"].get("aborted", 0)
    client = AsyncOpenAI(base_url=long_served.http_url + "/v1", api_key="unused", max_retries=0)
    async with client.audio.speech.with_streaming_response.create(
        model="m", voice="tara", input=TEXT, response_format="pcm", extra_body={"max_tokens": 1_000_000}
    ) as response:
        async for _ in response.iter_bytes():
            break  # leaving the block closes the connection
    await client.close()
    await until(lambda: idle(long_served))
    backend = engine_of(long_served).stats()["backend"]
    assert backend["aborted"] == before + 1 and backend["max_steps_to_abort"] <= 1


async def test_an_overloaded_server_answers_503_with_retry_after(served: ServerThread, remote: RemoteEngine) -> None:
    long_text = " ".join([TEXT] * 2)

    async def hold() -> None:
        async for _ in remote.synthesize(long_text):
            pass

    holders = [asyncio.create_task(hold()) for _ in range(MAX_STREAMS)]
    await until(lambda: engine_of(served).load >= 1.0, 60)
    req = urllib.request.Request(
        served.http_url + "/v1/audio/speech", data=json.dumps({"model": "m", "input": TEXT}).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(urllib.request.urlopen, req, timeout=30)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
    assert json.loads(refused.value.read())["error"]["code"] == "EngineOverloadedError"
    await asyncio.gather(*holders)


# ------------------------------------------------------------------------------------------ health, readiness, metrics
async def test_health_ready_and_metrics_describe_the_server(served: ServerThread, remote: RemoteEngine) -> None:
    await pcm_of(remote)
    assert http(served, "/health") == (200, b'{"status":"ok","reason":null,"draining":false}')
    assert http(served, "/ready")[0] == 200
    _, text = http(served, "/metrics")
    for name in (
        "orpheus_active_streams",
        "orpheus_streams_admitted_total",
        "orpheus_streams_rejected_total",
        "orpheus_ttfb_seconds_bucket",
        "orpheus_tokens_total",
        "orpheus_decoder_ticks_total",
        "orpheus_stream_errors_total",
        "orpheus_ws_connections",
    ):
        assert name.encode() in text, name
    assert metric(served, "orpheus_tokens_total") == engine_of(served).stats()["tokens"]
    assert metric(served, 'orpheus_ttfb_seconds_count{transport="ws"}') >= 1
    assert remote.ready and remote.health() == {"status": "ok", "reason": None}
    await until(lambda: remote.load < 1.0)  # status is pushed on change: an earlier test may have left it at 1.0
    assert remote.load >= 0.0


class HeldLoad(SyntheticBackend):
    """Synthetic tokens whose model load waits for `release`."""

    def __init__(self, config: SyntheticConfig):
        super().__init__(config)
        self.release = threading.Event()

    def _load(self) -> None:
        self.release.wait(60)


async def test_not_ready_while_the_engine_loads(synthetic_config: EngineConfig) -> None:
    backend = HeldLoad(synthetic_config.synthetic)
    engine = OrpheusEngine(synthetic_config, backend=backend)
    with serving_in_thread(engine) as srv:
        await until(lambda: engine.health()["status"] == "starting")
        assert http(srv, "/health")[0] == 200
        status, body = http(srv, "/ready")
        assert status == 503 and b"starting" in body
        remote = RemoteEngine(srv.url)
        await remote.start()  # connected: the server answers while it loads
        assert remote.health()["status"] == "starting" and not remote.ready
        backend.release.set()
        await until(lambda: http(srv, "/ready")[0] == 200)
        await until(lambda: remote.ready)
        assert (await pcm_of(remote)).size > 0
        await remote.aclose()


# ---------------------------------------------------------------------------------------------- drain, sockets
async def test_a_drain_past_its_deadline_ends_open_streams_with_an_engine_error(config: EngineConfig) -> None:
    with serving(endless(config), drain_timeout_s=0.3) as srv:
        remote = RemoteEngine(srv.url)
        chunks = remote.synthesize(TEXT, max_tokens=1_000_000)
        await chunks.__anext__()
        srv.server.begin_drain()
        with pytest.raises(EngineError) as ended:
            async for _ in chunks:
                pass
        assert type(ended.value) is EngineError  # not EngineClosedError: for a client, that server went away
        await until(lambda: srv.server.drained is False)
        await remote.aclose()


async def test_a_unix_socket_server_serves_a_remote_engine(synthetic_config: EngineConfig, tmp_path) -> None:
    with serving(synthetic_config, uds=str(tmp_path / "orpheus.sock")) as srv:
        remote = RemoteEngine(srv.url)
        assert_same_audio(await pcm_of(remote, seed=4), await pcm_of(engine_of(srv), seed=4))
        await remote.aclose()


# ---------------------------------------------------------------------------------------------- installation
@pytest.mark.parametrize(
    ("module", "use"),
    [
        ("fastapi", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        ("uvicorn", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        ("prometheus_client", "from orpheus_tts_plugin.cli import main; main(['serve', '--backend', 'synthetic'])"),
        (
            "websockets",
            "import orpheus_tts_plugin as o\ntry:\n    o.RemoteEngine\nexcept ImportError as e:\n    print(e)",
        ),
    ],
)
def test_a_missing_server_dependency_is_one_line_naming_the_extra(module: str, use: str) -> None:
    import subprocess
    import sys

    code = f"import sys; sys.modules[{module!r}] = None\n{use}\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = (done.stdout + done.stderr).strip()
    assert out.count("\n") == 0 and "pip install 'orpheus-tts-plugin[server]'" in out, out
