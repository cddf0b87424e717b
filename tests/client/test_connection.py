"""The client half of the WebSocket protocol: a server-side refusal arrives as the same exception class."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin import (
    SamplingOverrides,
)
from orpheus_tts_plugin.client.connection import Connection
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.wire import protocol
from tests.served import (
    TEXT,
)


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
