"""A server that names a replica (as each does behind Ray Serve's proxy) gets every stream as an HTTP post of its own:
the client keeps no WebSocket after the hello (a replica would count it as an open request for its whole life, and
Ray routes, scales and drains on those), the audio is the engine's, a cancel aborts, and a server that went away is
said hello to again once it is back. Without Ray: `serve` threads on loopback, at both paces (the `config` fixture).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from orpheus_tts_plugin import EngineConfig, RemoteEngine
from orpheus_tts_plugin.errors import EngineError, Failure, failure_of
from orpheus_tts_plugin.tools.loopback import free_port
from tests.served import TEXT, assert_same_audio, endless, engine_of, idle, metric, pcm_of, serving, until


async def test_after_the_hello_no_websocket_is_held_and_each_posted_stream_is_the_engines_audio(
    config: EngineConfig,
) -> None:
    with serving(config, replica="r1") as srv:
        remote = RemoteEngine(srv.url)
        try:
            await remote.start()
            assert remote.ready and remote.health()["status"] == "ok"
            await until(lambda: metric(srv, "orpheus_ws_connections") == 0)
            got = await asyncio.gather(*(pcm_of(remote, TEXT, seed=i) for i in range(3)))
            for seed, pcm in enumerate(got):
                assert_same_audio(pcm, await pcm_of(engine_of(srv), TEXT, seed=seed))
            assert metric(srv, "orpheus_ws_connections") == 0
            assert remote.stats()["servers"][srv.url]["replicas"] == {"r1": 3}
            assert (await remote.server_stats())["streams_completed"] >= 3
        finally:
            await remote.aclose()


async def test_the_load_is_polled_a_cancel_aborts_and_a_server_gone_and_back_is_said_hello_to_again(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orpheus_tts_plugin.client import stream_posts

    monkeypatch.setattr(stream_posts, "POLL_S", 0.1)
    port = free_port()
    remote: RemoteEngine | None = None
    try:
        with serving(endless(config), port=port, replica="r1") as srv:
            remote = RemoteEngine(srv.url, backoff_s=(0.05, 0.2), connect_timeout_s=1.0)
            await remote.start()
            assert remote.load == 0.0
            speech = remote.synthesize(TEXT)
            await speech.__anext__()
            assert engine_of(srv).stats()["active_streams"] == 1
            await until(lambda: remote.load == 1 / config.max_streams)  # the server's load, polled
            await speech.aclose()
            await until(lambda: idle(srv) and remote.load == 0.0)
        try:  # the server is gone: a new stream finds nobody there (within connect_timeout_s)
            await pcm_of(remote, TEXT)
        except EngineError as exc:
            # "lost" if the stream found out, "cannot reach" if the load poll did first (no server to say hello to)
            assert "lost" in str(exc) or "cannot reach" in str(exc), exc
            assert failure_of(exc, serving=True) is Failure.STREAM_FAILED
        else:
            raise AssertionError("a stream to a server that is gone ended whole")
        assert not remote.ready
        with serving(endless(config), port=port, replica="r2") as srv:
            await until(lambda: remote.ready)
            speech = remote.synthesize(TEXT)
            await speech.__anext__()
            await speech.aclose()
            assert remote.stats()["servers"][srv.url]["replicas"] == {"r1": 1, "r2": 1}
            await until(lambda: metric(srv, "orpheus_ws_connections") == 0 and idle(srv))
    finally:
        if remote is not None:
            began = time.monotonic()
            await remote.aclose()
            assert time.monotonic() - began < 5


async def test_a_posted_stream_that_hears_nothing_for_its_silence_limit_ends_with_a_retryable_error() -> None:
    """A hung proxy or replica (it took the request and went silent): no socket is held to ping, so the stream's
    own silence ends it, as a lost connection."""
    from orpheus_tts_plugin.client.stream_posts import StreamPosts
    from orpheus_tts_plugin.wire import protocol

    released = asyncio.Event()

    async def hung(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await released.wait()  # then nothing, until the test ends
        writer.close()

    server = await asyncio.start_server(hung, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    posts = StreamPosts(f"http://127.0.0.1:{port}", None, None, 5.0, silence_s=0.3)
    got: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    try:
        began = time.monotonic()
        posts.start(protocol.STREAMS_PATH, protocol.Start(TEXT), lambda item: got.done() or got.set_result(item))
        error = await asyncio.wait_for(got, 10)
        assert isinstance(error, EngineError) and "lost" in str(error), error
        assert failure_of(error, serving=True) is Failure.STREAM_FAILED and time.monotonic() - began < 5
    finally:
        await posts.aclose(EngineError("closed"))
        released.set()
        server.close()
        await server.wait_closed()
