"""A server that names a replica (as each does behind Ray Serve's proxy) gets every stream as an HTTP post of its own:
the client keeps no WebSocket after the hello (a replica would count it as an open request for its whole life, and
Ray routes, scales and drains on those), the audio is the engine's, a cancel aborts, and a server that went away is
said hello to again once it is back. Without Ray: `serve` threads on loopback, at both paces (the `config` fixture).
"""

from __future__ import annotations

import asyncio
import time

from orpheus_tts_plugin import EngineConfig, RemoteEngine
from orpheus_tts_plugin.errors import EngineError, Failure, failure_of
from orpheus_tts_plugin.tools.loopback import free_port
from tests.server.harness import TEXT, assert_same_audio, endless, engine_of, idle, metric, pcm_of, serving, until


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


async def test_a_cancel_aborts_a_posted_stream_and_a_server_gone_and_back_is_said_hello_to_again(
    config: EngineConfig,
) -> None:
    port = free_port()
    remote: RemoteEngine | None = None
    try:
        with serving(endless(config), port=port, replica="r1") as srv:
            remote = RemoteEngine(srv.url, backoff_s=(0.05, 0.2))
            await remote.start()
            speech = remote.synthesize(TEXT)
            await speech.__anext__()
            assert engine_of(srv).stats()["active_streams"] == 1
            await speech.aclose()
            await until(lambda: idle(srv))
        try:  # the server is gone: a new stream finds nobody there
            await pcm_of(remote, TEXT)
        except EngineError as exc:
            assert "lost" in str(exc) and failure_of(exc, serving=True) is Failure.STREAM_FAILED
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
