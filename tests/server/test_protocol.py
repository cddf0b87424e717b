"""The wire format as the server reads it: a malformed message gets an error naming its class; the connection lives."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.wire import protocol


@pytest.mark.parametrize(
    "message, error",
    [
        ('{"type": "start", "id": 1, "text": 3}', "TypeError"),
        ('{"type": "start", "id": 1, "text": "hi", "sampling": {"temp": 1}}', "TypeError"),
        ('{"type": "start", "id": 1, "text": "hi", "speculative": 1}', "TypeError"),
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
