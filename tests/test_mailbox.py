"""The producer-to-consumer hand-off on one event loop: order, waking, the end and its error."""

from __future__ import annotations

import asyncio

import pytest

from orpheus_tts_plugin.runtime.mailbox import Mailbox


async def test_a_mailbox_hands_out_items_in_order_then_its_end() -> None:
    box: Mailbox[int] = Mailbox()
    for i in range(3):
        box.put(i)
    box.end()
    assert box.ended
    assert [await box.get() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(StopAsyncIteration):
        await box.get()


async def test_a_waiting_consumer_wakes_for_the_next_item() -> None:
    box: Mailbox[str] = Mailbox()
    got = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    assert not got.done()
    box.put("a")
    assert await asyncio.wait_for(got, 1) == "a"


async def test_an_end_with_an_error_raises_it_once_after_the_items_left() -> None:
    box: Mailbox[int] = Mailbox()
    box.put(1)
    box.end(RuntimeError("backend died"))
    assert await box.get() == 1
    with pytest.raises(RuntimeError, match="backend died"):
        await box.get()
    with pytest.raises(StopAsyncIteration):
        await box.get()


async def test_a_waiting_consumer_wakes_at_the_end() -> None:
    box: Mailbox[int] = Mailbox()
    got = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    box.end()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(got, 1)


async def test_clear_drops_the_items_not_yet_taken() -> None:
    box: Mailbox[int] = Mailbox()
    box.put(1)
    box.put(2)
    box.clear()
    box.put(3)
    assert await box.get() == 3
