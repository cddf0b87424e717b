"""RemoteEngine against `orpheus-tts serve` in a thread on loopback: many streams on one connection, the same audio
as in process, cancellation, overload, local checks of voices and options, a Unix socket."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from orpheus_tts_plugin import (
    EngineConfig,
    EngineOverloadedError,
    RemoteEngine,
)
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.spec import SAMPLE_RATE
from tests.served import (
    MAX_STREAMS,
    TEXT,
    assert_same_audio,
    engine_of,
    http,
    idle,
    metric,
    one_connection,
    pcm_of,
    serving,
    until,
)


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


async def test_a_unix_socket_server_serves_a_remote_engine(synthetic_config: EngineConfig, tmp_path) -> None:
    with serving(synthetic_config, uds=str(tmp_path / "orpheus.sock")) as srv:
        remote = RemoteEngine(srv.url)
        assert_same_audio(await pcm_of(remote, seed=4), await pcm_of(engine_of(srv), seed=4))
        await remote.aclose()
