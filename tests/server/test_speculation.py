"""Speculative streams through `serve` and RemoteEngine: the client's confirm or discard reaches the server's engine,
which counts each once, however its stream ended; /metrics shows the counts and what discarded ones cost."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from orpheus_tts_plugin import EngineConfig, RemoteEngine
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.spec import SAMPLE_RATE, SAMPLES_PER_FRAME
from orpheus_tts_plugin.speculation import STAT_KEYS
from orpheus_tts_plugin.wire import protocol
from tests.served import TEXT, engine_of, idle, metric, serving, until

SHORT = {"text": "Hello there.", "max_tokens": 56}  # ends whole soon at either pace
SETTLED = "orpheus_speculative_streams_settled_total"


def _counts(stats: dict, before: dict) -> tuple[int, ...]:
    return tuple(stats[k] - before[k] for k in STAT_KEYS[:3])


async def test_a_remote_speculation_confirmed_while_it_speaks_after_it_ended_or_before_it_began_counts_confirmed(
    served: ServerThread, remote: RemoteEngine
) -> None:
    engine = engine_of(served)
    before, here = engine.stats(), remote.stats()
    speaking = remote.synthesize(**SHORT, speculative=True)
    await anext(speaking)
    speaking.confirm()
    assert [chunk async for chunk in speaking][-1].final
    ended = remote.synthesize(**SHORT, speculative=True)
    assert [chunk async for chunk in ended][-1].final
    ended.confirm()  # the server's stream is over: its speculation waits for this
    early = remote.synthesize(**SHORT, speculative=True)
    early.confirm()
    assert [chunk async for chunk in early][-1].final
    await until(lambda: _counts(engine.stats(), before) == (3, 3, 0))
    assert _counts(remote.stats(), here) == (3, 3, 0)
    await asyncio.sleep(0.05)
    assert _counts(engine.stats(), before) == (3, 3, 0)  # nothing is counted twice


async def test_a_remote_speculation_closed_left_or_dropped_unconfirmed_is_discarded_and_aborted(
    served: ServerThread, remote: RemoteEngine
) -> None:
    engine = engine_of(served)
    before = engine.stats()
    discarded_metric = metric(served, SETTLED + '{outcome="discarded"}')
    speaking = remote.synthesize(TEXT * 3, speculative=True)
    await anext(speaking)
    await speaking.aclose()
    ended = remote.synthesize(**SHORT, speculative=True)
    assert [chunk async for chunk in ended][-1].final
    await ended.aclose()
    dropped = remote.synthesize(**SHORT, speculative=True)
    assert [chunk async for chunk in dropped][-1].final
    del dropped
    remote.stats()  # the client's tally settles what was dropped at its next call
    await until(lambda: _counts(engine.stats(), before) == (3, 0, 3) and idle(served))
    after = engine.stats()
    generated = (after["frames"] - before["frames"]) * SAMPLES_PER_FRAME / SAMPLE_RATE
    lost = after["speculative_discarded_audio_s"] - before["speculative_discarded_audio_s"]
    assert 0 < lost <= generated + 1e-3
    assert after["backend"]["max_steps_to_abort"] <= 1
    assert metric(served, SETTLED + '{outcome="discarded"}') == discarded_metric + 3
    assert metric(served, "orpheus_speculative_discarded_audio_seconds_total") >= lost
    assert metric(served, "orpheus_speculative_streams_started_total") >= 3


async def test_a_closed_connection_discards_its_unsettled_speculations_and_plain_streams_count_none(
    served: ServerThread,
) -> None:
    engine = engine_of(served)
    before = engine.stats()
    client = RemoteEngine(served.url)
    try:
        plain = client.synthesize(**SHORT)
        plain.confirm()
        assert [chunk async for chunk in plain][-1].final
        held = client.synthesize(**SHORT, speculative=True)
        assert [chunk async for chunk in held][-1].final
        await asyncio.sleep(0.05)
        assert _counts(engine.stats(), before) == (1, 0, 0)
    finally:
        await client.aclose()
    await until(lambda: _counts(engine.stats(), before) == (1, 0, 1))


async def test_posted_streams_behind_a_proxy_are_counted_by_the_client_only(config: EngineConfig) -> None:
    with serving(config, replica="r1") as srv:
        engine = engine_of(srv)
        client = RemoteEngine(srv.url)
        try:
            confirmed = client.synthesize(**SHORT, speculative=True)
            assert [chunk async for chunk in confirmed][-1].final
            confirmed.confirm()
            discarded = client.synthesize(**SHORT, speculative=True)
            await anext(discarded)
            await discarded.aclose()
            await until(lambda: idle(srv))
            assert client.stats()["servers"][srv.url]["replicas"] == {"r1": 2}  # both were posted
            assert _counts(client.stats(), dict.fromkeys(STAT_KEYS, 0)) == (2, 1, 1)
            assert _counts(engine.stats(), dict.fromkeys(STAT_KEYS, 0)) == (0, 0, 0)
        finally:
            await client.aclose()


def test_the_flag_travels_only_when_set_and_the_hello_says_whether_a_server_counts_speculation(
    served: ServerThread,
) -> None:
    start = protocol.Start("Hi.", speculative=True)
    assert protocol.Start.parse(start.message(3)) == start
    assert "speculative" not in protocol.Start("Hi.").message(3)  # the start message older servers know
    hello = served.service.hello()
    assert hello.speculation and protocol.Hello.parse(hello.message()).speculation
    older = replace(hello, speculation=False).message()
    assert "speculation" not in older and not protocol.Hello.parse(older).speculation
