"""`orpheus-tts serve` against careless and hostile clients, on loopback: keys, limits, malformed input, errors.

A server with keys and small limits runs in a thread; the clients here are raw sockets, raw WebSockets and
urllib, written to misbehave. Every test runs with generation faster than decoding and slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from orpheus_tts_plugin import (
    EngineConfig,
    EngineOverloadedError,
    KeyRefusedError,
    OrpheusEngine,
    RemoteEngine,
    SamplingOverrides,
)
from orpheus_tts_plugin import SyntheticConfig as Synthetic
from orpheus_tts_plugin.server.policy import Policy, bearer, load_keys
from orpheus_tts_plugin.server.serve import ServerThread, _loopback, serving_in_thread
from orpheus_tts_plugin.wire import protocol
from tests.served import PACES, TEXT

KEY, OTHER_KEY, METRICS_KEY = "k-" + "a" * 30, "k-" + "b" * 30, "m-" + "c" * 30
SHORT = {"model": "m", "input": TEXT, "max_tokens": 200}  # an HTTP request that ends
POLICY = Policy(
    api_keys=frozenset({KEY, OTHER_KEY}),
    metrics_key=METRICS_KEY,
    max_chars=200,
    max_message_bytes=4096,
    max_json_depth=4,
    streams_per_connection=2,
    streams_per_key=3,
    send_buffer_s=0.5,
    slow_consumer_timeout_s=1.0,
    auth_timeout_s=0.3,
    header_timeout_s=0.5,
)


@pytest.fixture(scope="module", params=list(PACES))
def guarded(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[ServerThread]:
    pace = PACES[request.param]  # utterances that never end by themselves: a held stream stays open however fast
    config = replace(
        synthetic_config,
        max_streams=8,
        token_budget_base=1_000_000,
        synthetic=Synthetic(pace, endless=True),
        # A stalled reader's generation pauses once 0.1 s of its audio is unread, far inside the 1 s slow-consumer
        # limit; at 0.5 s a host at load 5 on 2 cores let the limit end an HTTP stream before its pause.
        pause_unread_s=0.1,
    )
    engine = OrpheusEngine(config)
    with serving_in_thread(engine, policy=POLICY, socket_send_buffer=16_384) as srv:
        asyncio.run(engine.start())
        yield srv


def http(
    srv: ServerThread, path: str, body: bytes | dict | None = None, key: str | None = KEY, method: str | None = None
) -> tuple[int, Message, bytes]:
    """(status, headers, body) of a request; `body` a dict is sent as JSON, bytes as they are."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(srv.http_url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def openai_error(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error body (asserting its shape)."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def metric(srv: ServerThread, name: str) -> float:
    _, _, text = http(srv, "/metrics", key=METRICS_KEY)
    lines = [line for line in text.decode().splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@contextlib.asynccontextmanager
async def raw_ws(srv: ServerThread, key: str | None = KEY) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with connect(srv.url + protocol.WS_PATH, compression=None, proxy=None, additional_headers=headers) as ws:
        yield ws


async def next_of(ws: ClientConnection, *types: str) -> dict[str, Any]:
    """The next JSON message of one of `types` (binary audio and other types skipped)."""
    while True:
        message = await asyncio.wait_for(ws.recv(), 30)
        if isinstance(message, str) and (reply := protocol.decode(message))["type"] in types:
            return reply


async def terminals(ws: ClientConnection, sid: int, quiet_s: float = 1.0) -> list[str]:
    """Every terminal message for stream `sid` until the connection is quiet for `quiet_s` after the first."""
    seen: list[str] = []
    while True:
        try:
            message = await asyncio.wait_for(ws.recv(), quiet_s if seen else 30)
        except asyncio.TimeoutError:
            return seen
        if isinstance(message, bytes):
            if protocol.audio_stream_id(message) == sid and message[4] & protocol.FINAL:
                seen.append("final")
        elif (reply := protocol.decode(message))["type"] in ("end", "error") and reply["id"] == sid:
            seen.append(reply["type"])


def start(sid: int, text: str = TEXT) -> str:
    """A `start` message for an utterance that ends (200 tokens)."""
    return protocol.encode(protocol.Start(text, sampling=SamplingOverrides(max_tokens=200)).message(sid))


# ---------------------------------------------------------------------------------------------- keys
def test_http_without_or_with_a_wrong_key_is_401_in_openai_shape_and_counted(guarded: ServerThread) -> None:
    before = metric(guarded, "orpheus_auth_failures_total")
    for key in (None, "wrong", KEY[:-1]):
        status, headers, body = http(guarded, "/v1/audio/speech", {"model": "m", "input": TEXT}, key=key)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert openai_error(body)["type"] == "authentication_error"
    status, headers, body = http(guarded, "/v1/audio/speech", {**SHORT, "response_format": "pcm"})
    assert status == 200 and len(body) > 0
    assert http(guarded, "/v1/audio/speech", SHORT, key=OTHER_KEY)[0] == 200
    assert metric(guarded, "orpheus_auth_failures_total") == before + 3


def test_health_and_ready_need_no_key_and_metrics_needs_its_own(guarded: ServerThread) -> None:
    assert http(guarded, "/health", key=None)[0] == 200
    assert http(guarded, "/ready", key=None)[0] == 200
    assert http(guarded, "/metrics", key=None)[0] == 401
    assert http(guarded, "/metrics", key=KEY)[0] == 401  # an API key is not the metrics key
    assert http(guarded, "/metrics", key=METRICS_KEY)[0] == 200
    assert http(guarded, "/stats", key=None)[0] == 401


async def test_a_websocket_with_its_key_in_the_header_or_a_first_auth_message_is_served(
    guarded: ServerThread,
) -> None:
    remote = RemoteEngine(guarded.url, api_key=KEY)
    try:
        assert [c async for c in remote.synthesize(TEXT, seed=1, max_tokens=200)][-1].final
    finally:
        await remote.aclose()
    async with raw_ws(guarded, key=None) as ws:
        await ws.send(protocol.encode({"type": "auth", "key": OTHER_KEY}))
        assert (await next_of(ws, "hello"))["protocol"] == protocol.PROTOCOL_VERSION


@pytest.mark.parametrize("how", ["wrong header", "wrong auth message", "nothing in time", "another message first"])
async def test_a_websocket_without_a_valid_key_is_closed_with_1008(guarded: ServerThread, how: str) -> None:
    before = metric(guarded, "orpheus_auth_failures_total")
    started = time.monotonic()
    async with raw_ws(guarded, key="wrong" if how == "wrong header" else None) as ws:
        if how == "wrong auth message":
            await ws.send(protocol.encode({"type": "auth", "key": "wrong"}))
        elif how == "another message first":
            await ws.send(start(1))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert time.monotonic() - started < 5
    assert metric(guarded, "orpheus_auth_failures_total") == before + 1


@pytest.mark.parametrize(
    "key, says",
    [(None, "needs an API key and none was given .no API key given.: pass api_key= or set .ORPHEUS_API_KEY"),
     ("wrong", "refused the API key given .the API key is not valid.")],
    ids=["no key", "wrong key"],
)  # fmt: skip
async def test_remote_engine_without_its_key_fails_at_once_in_one_line_naming_the_key(
    guarded: ServerThread, key: str | None, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORPHEUS_API_KEY", raising=False)
    before = metric(guarded, "orpheus_auth_failures_total")
    remote = RemoteEngine(guarded.url, api_key=key, connect_timeout_s=60.0)
    started = time.monotonic()
    try:
        with pytest.raises(KeyRefusedError, match=f"^{guarded.url} {says}") as refused:
            await remote.start()
        assert time.monotonic() - started < 30  # not the connect timeout: the first refusal says it all
        assert "\n" not in str(refused.value)
        with pytest.raises(KeyRefusedError):  # a call says the same
            await anext(remote.synthesize(TEXT))
    finally:
        await remote.aclose()
    assert metric(guarded, "orpheus_auth_failures_total") >= before + 1


async def test_a_keyless_clients_auth_message_is_ignored_by_a_server_without_keys(
    synthetic_config: EngineConfig,
) -> None:
    with serving_in_thread(OrpheusEngine(synthetic_config)) as srv:
        async with raw_ws(srv, key=None) as ws:
            await ws.send(protocol.encode(protocol.auth(None)))  # what RemoteEngine sends when it has no key
            assert (await next_of(ws, "hello"))["protocol"] == protocol.PROTOCOL_VERSION
            await ws.send(start(1))
            while not isinstance(message := await asyncio.wait_for(ws.recv(), 30), bytes) or not (
                message[4] & protocol.FINAL
            ):
                assert isinstance(message, bytes) or protocol.decode(message)["type"] == "status", message


async def test_remote_engine_refuses_a_text_over_the_servers_limit_at_once_naming_it(guarded: ServerThread) -> None:
    remote = RemoteEngine(guarded.url, api_key=KEY)
    try:
        await remote.start()  # its hello names the server's limit
        with pytest.raises(ValueError, match=r"text of 205 characters is over the server's limit of 200 \(serve"):
            remote.synthesize("word " * 41)
        assert remote.stats().get("streams_started", 0) == 0
    finally:
        await remote.aclose()


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nfile-key\n\n  spaced  \n")
    found = load_keys(["flag-key", " "], str(keys), environ={"ORPHEUS_API_KEYS": "env-1, env-2,"})
    assert found == {"flag-key", "file-key", "spaced", "env-1", "env-2"}
    with pytest.raises(ValueError, match="cannot read the API key file .*missing"):
        load_keys([], str(tmp_path / "missing"), environ={})
    assert bearer("Bearer abc") == bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is bearer("Bearer ") is bearer(None) is None
    assert Policy(api_keys=frozenset({"a"})).key_accepted("a") and not Policy(api_keys=frozenset({"a"})).key_accepted(
        None
    )


def test_only_loopback_addresses_count_as_loopback() -> None:
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.0.2.7") and not _loopback("no-such-host.invalid")


# ---------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"model": "m", "input": ""}, 400, "invalid_request_error"),
        ({"model": "m", "input": "   "}, 400, "invalid_request_error"),
        ({"model": "m", "input": "word " * 41}, 413, "invalid_request_error"),
        (b"[" * 3000, 400, "invalid_request_error"),  # past the parser's recursion limit: RecursionError
        (b'{"model": "m", "input": "hi", "voice": {"id": [[[["tara"]]]]}}', 400, "invalid_request_error"),
        (b"x" * 5000, 413, "invalid_request_error"),  # over max_message_bytes
        (b"{not json", 400, "invalid_request_error"),
    ],
    ids=["empty", "blank", "too long", "nested past recursion", "nested past the limit", "oversize", "not json"],
)
def test_bad_and_oversize_http_bodies_get_openai_errors_not_500(
    guarded: ServerThread, body: bytes | dict, status: int, kind: str
) -> None:
    got, _, raw = http(guarded, "/v1/audio/speech", body)
    assert got == status and openai_error(raw)["type"] == kind
    assert http(guarded, "/health", key=None)[0] == 200


def test_wrong_methods_and_paths_get_openai_errors(guarded: ServerThread) -> None:
    status, _, body = http(guarded, "/v1/audio/speech", method="GET")
    assert status == 405 and openai_error(body)["code"] == "method_not_allowed"
    status, _, body = http(guarded, "/v1/nowhere")
    assert status == 404 and openai_error(body)["code"] == "not_found"


@pytest.mark.parametrize(
    "message, match",
    [
        ("[" * 3000, "nested too deeply"),
        ('{"type": "start", "id": 1, "text": "hi", "sampling": {"a": {"b": {"c": {}}}}}', "nested deeper"),
        (start(1, "word " * 41), "over this server's limit of 200"),
    ],
    ids=["nested past recursion", "nested past the limit", "too long"],
)
async def test_bad_websocket_messages_get_an_error_and_the_connection_and_its_streams_go_on(
    guarded: ServerThread, message: str, match: str
) -> None:
    async with raw_ws(guarded) as ws:
        await ws.send(start(7))
        await ws.send(message)
        reply = await next_of(ws, "error")
        assert match in reply["message"] and reply["id"] in (None, 1)
        assert await terminals(ws, 7) == ["final"]


async def test_a_websocket_message_over_the_size_limit_closes_with_1009(guarded: ServerThread) -> None:
    async with raw_ws(guarded) as ws:
        await next_of(ws, "hello")
        await ws.send("x" * 5000)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_a_duplicate_stream_id_is_refused_and_the_live_stream_ends_once(guarded: ServerThread) -> None:
    async with raw_ws(guarded) as ws:
        await ws.send(start(5))
        await ws.send(start(5))
        reply = await next_of(ws, "error")
        assert reply["id"] is None and "stream id 5 is already in use" in reply["message"]
        assert await terminals(ws, 5) == ["final"]


async def test_one_connection_holds_at_most_its_share_of_streams(guarded: ServerThread) -> None:
    remote = RemoteEngine(guarded.url, api_key=KEY)
    long_text = " ".join([TEXT] * 3)
    try:
        held = [remote.synthesize(long_text, max_tokens=1_000_000) for _ in range(2)]
        for stream in held:
            await asyncio.wait_for(stream.__anext__(), 30)
        with pytest.raises(EngineOverloadedError, match="this connection has 2 streams open"):
            async for _ in remote.synthesize(TEXT, max_tokens=200):
                pass
        for stream in held:
            await stream.aclose()
    finally:
        await remote.aclose()


async def test_one_key_holds_at_most_its_share_of_streams_and_http_says_429(guarded: ServerThread) -> None:
    remotes = [RemoteEngine(guarded.url, api_key=KEY) for _ in range(2)]
    long_text = " ".join([TEXT] * 3)
    try:
        held = [r.synthesize(long_text, max_tokens=1_000_000) for r in (remotes[0], remotes[1], remotes[1])]
        for stream in held:
            await asyncio.wait_for(stream.__anext__(), 30)
        status, headers, body = await asyncio.to_thread(http, guarded, "/v1/audio/speech", SHORT)
        assert status == 429 and headers["Retry-After"] == "1" and "this API key has 3 streams" in body.decode()
        assert (await asyncio.to_thread(http, guarded, "/v1/audio/speech", SHORT, OTHER_KEY))[0] == 200
        for stream in held:
            await stream.aclose()
    finally:
        for remote in remotes:
            await remote.aclose()


# ---------------------------------------------------------------------------------------------- idle sockets
def test_sockets_that_never_finish_their_headers_are_closed_after_the_header_timeout(guarded: ServerThread) -> None:
    host, port = guarded.http_url.removeprefix("http://").split(":")
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(50)]
    trickling = socket.create_connection((host, int(port)), timeout=10)
    trickling.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    started = time.monotonic()
    for sock in [*silent, trickling]:
        assert sock.recv(1024) == b""  # EOF: the server closed it (a socket timeout here fails the test)
    assert time.monotonic() - started < 5
    for sock in [*silent, trickling]:
        sock.close()
    assert http(guarded, "/health", key=None)[0] == 200


# ---------------------------------------------------------------------------------------------- backpressure
async def test_a_client_that_stops_reading_gets_its_stream_ended_as_a_slow_consumer(guarded: ServerThread) -> None:
    before = metric(guarded, "orpheus_slow_consumers_total")
    host, port = guarded.http_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel holds little for a client that stalls
    sock.connect((host, int(port)))
    headers = {"Authorization": f"Bearer {KEY}"}
    uri = guarded.url + protocol.WS_PATH
    async with connect(uri, sock=sock, compression=None, proxy=None, additional_headers=headers, max_queue=1) as ws:
        await next_of(ws, "hello")
        await ws.send(protocol.encode(protocol.Start(TEXT, sampling=SamplingOverrides(max_tokens=10**6)).message(3)))
        engine = guarded.service.engine
        pauses = engine.stats().get("generation_pauses", 0)
        await until_slow_consumer(guarded, before)  # not reading meanwhile
        assert engine.stats()["generation_pauses"] > pauses  # its generation waited for it before it was ended
        await until_idle(engine)
        assert await terminals(ws, 3) == ["error"]  # after the audio it had queued, in order


def test_an_http_client_that_stops_reading_has_its_response_cut_as_a_slow_consumer(guarded: ServerThread) -> None:
    before = metric(guarded, "orpheus_slow_consumers_total")
    engine = guarded.service.engine
    pauses = engine.stats().get("generation_pauses", 0)
    body = json.dumps({"model": "m", "input": TEXT, "response_format": "pcm", "max_tokens": 10**6}).encode()
    host, port = guarded.http_url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        asyncio.run(until_slow_consumer(guarded, before))  # reading nothing meanwhile
        assert engine.stats()["generation_pauses"] > pauses
        asyncio.run(until_idle(engine))
        sock.settimeout(30)
        received = b""
        while piece := sock.recv(65536):  # what it had buffered, then EOF: the server closed the connection
            received += piece
    assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"0\r\n\r\n")  # cut, not ended


async def until_slow_consumer(srv: ServerThread, before: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(srv, "orpheus_slow_consumers_total") == before:
        assert time.monotonic() < deadline, "the stalled stream was never ended"
        await asyncio.sleep(0.2)


async def until_idle(engine: OrpheusEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats()["active_streams"]:
        assert time.monotonic() < deadline, "the engine stream was not aborted"
        await asyncio.sleep(0.05)
