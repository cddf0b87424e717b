"""The event loop in a daemon thread that OrpheusEngine and RemoteEngine share, its outbox and its registry."""

from __future__ import annotations

import asyncio
import threading

import pytest

from orpheus_tts_plugin.runtime.loop_thread import LoopThread, Outbox, SharedInstances, post
from orpheus_tts_plugin.runtime.mailbox import Mailbox


class _Stream:
    """A caller's end of a stream, as the engines' streams are: a loop, a mailbox, and `put`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.box: Mailbox[object] = Mailbox()

    def put(self, item: object) -> None:
        if item == "boom":
            raise RuntimeError("this caller's handler is broken")
        self.box.put(item)


def test_a_loop_thread_boots_runs_what_it_is_given_and_stops_after_its_shutdown() -> None:
    thread = LoopThread("test-loop")
    events: list[str] = []

    async def boot() -> None:
        events.append(f"boot on {threading.current_thread().name}")

    async def shutdown() -> None:
        events.append("shutdown")

    async def main() -> None:
        await asyncio.wrap_future(thread.start(boot, lambda: events.append("stopped")))
        assert await thread.run(asyncio.sleep(0, result=7)) == 7
        await thread.stop(shutdown)

    asyncio.run(main())
    assert events == ["boot on test-loop", "shutdown", "stopped"]
    assert thread.loop.is_closed()


def test_a_failed_boot_is_the_futures_exception_and_closes_the_loop() -> None:
    thread = LoopThread("test-loop")

    async def boot() -> None:
        raise OSError("no weights")

    with pytest.raises(OSError, match="no weights"):
        thread.start(boot, lambda: pytest.fail("a loop that never ran cannot stop")).result(timeout=10)
    thread._thread.join(10)
    assert thread.loop.is_closed()


def test_an_outbox_sends_one_call_per_caller_loop_and_names_the_streams_whose_loop_is_closed() -> None:
    live, dead = asyncio.new_event_loop(), asyncio.new_event_loop()
    dead.close()
    a, b, gone = _Stream(live), _Stream(live), _Stream(dead)
    outbox: Outbox[_Stream] = Outbox()
    for stream, item in [(a, 1), (b, "boom"), (gone, 3), (a, 2)]:
        outbox.add(stream, item)
    assert outbox.send() == [gone]
    assert not outbox
    assert len(live._ready) == 1  # one call for both streams of that loop

    async def drain() -> tuple[list[object], BaseException | None]:
        got = [await a.box.get(), await a.box.get()]
        try:
            await b.box.get()
        except Exception as exc:  # noqa: BLE001 - what the broken caller ends with
            return got, exc
        return got, None

    got, error = live.run_until_complete(drain())
    live.close()
    assert got == [1, 2]
    assert "delivery failed" in str(error)  # one caller's failure ends its stream, not the others' delivery


def test_post_to_a_stream_whose_loop_is_closed_drops_the_item() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    post(_Stream(loop), "late")  # no exception: nobody listens


def test_shared_instances_give_the_same_one_until_it_is_closed() -> None:
    class Thing:
        closed = False

    shared: SharedInstances[str, Thing] = SharedInstances(lambda thing: thing.closed)
    first = shared.get("k", Thing)
    assert shared.get("k", Thing) is first
    assert shared.get("other", Thing) is not first
    first.closed = True
    assert shared.get("k", Thing) is not first
