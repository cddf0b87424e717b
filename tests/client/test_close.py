"""`RemoteEngine.aclose()` returns promptly whatever its servers do: killed (SIGKILL), stopped (SIGSTOP) mid-stream,
never reachable (nothing listens; a listener that never answers the handshake), reconnecting as it closes.

The servers are `orpheus-tts serve` processes: synthetic tokens flat out, and hf on the test model (the set-up in
which a RemoteEngine's close was seen to hang after its server was killed).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineClosedError, EngineError, RemoteEngine
from orpheus_tts_plugin.client.connection import CLOSE_TIMEOUT_S
from orpheus_tts_plugin.tools.loopback import free_port
from orpheus_tts_plugin.types import AudioChunk
from tests.served import PACES, TEXT
from tests.servers import serve_args, serve_process

PROMPT_S = CLOSE_TIMEOUT_S + 2.0  # a close may wait out one close handshake; a hang waits for ever
LONG = " ".join([TEXT] * 10)


def server_args(kind: str, model: Path, port: int) -> list[str]:
    if kind == "hf":
        return [
            "serve", "--backend", "hf", "--model", str(model / "orpheus"), "--snac", str(model / "snac"),
            "--device", "cpu", "--port", str(port),
        ]  # fmt: skip
    return serve_args(model / "snac", port, PACES[kind])


async def closed_promptly(remote: RemoteEngine) -> float:
    """Seconds `remote.aclose()` took; fails the test if it takes longer than PROMPT_S."""
    began = time.monotonic()
    await asyncio.wait_for(remote.aclose(), PROMPT_S)
    return time.monotonic() - began


async def ending(chunks: AsyncIterator[AudioChunk]) -> BaseException | None:
    """What ends a stream: its error, or None if it ends whole."""
    try:
        async for _ in chunks:
            pass
    except (EngineError, ValueError, TypeError) as exc:
        return exc
    return None


# The client's close is the subject, not the engine: synthetic tokens flat out, and hf on the test model (paced by
# the model), in which the hang was seen.
@pytest.mark.parametrize("kind", ["fast", "hf"])
async def test_a_remote_engine_closes_promptly_after_its_server_is_stopped_or_killed_mid_stream(
    test_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    port = free_port()
    with serve_process(server_args(kind, test_model_dir, port), tmp_path / "serve.log") as proc:
        for how in (signal.SIGSTOP, signal.SIGKILL):  # stopped, then (resumed) killed: one server for both
            remote = RemoteEngine(f"ws://127.0.0.1:{port}")
            try:
                await remote.start()
                chunks = remote.synthesize(LONG, seed=1, max_tokens=100_000)
                await asyncio.wait_for(chunks.__anext__(), 30)
                proc.send_signal(how)
                if how == signal.SIGKILL:  # the stream ends at once with the retryable error; then close
                    with pytest.raises(EngineError, match="lost"):
                        async for _ in chunks:
                            pass
                    await asyncio.sleep(0.3)  # reconnecting to the dead server while it closes
                    await closed_promptly(remote)
                else:  # the socket stays open and silent: close, and the open stream ends as closed
                    reading = asyncio.ensure_future(ending(chunks))
                    await closed_promptly(remote)
                    assert type(await asyncio.wait_for(reading, 1)) is EngineClosedError
                    proc.send_signal(signal.SIGCONT)
            finally:
                await asyncio.wait_for(remote.aclose(), PROMPT_S)


async def test_a_remote_engine_closes_promptly_while_it_reconnects_to_a_server_that_is_not_there() -> None:
    # Refused connects return at once: a close lands at every point of the reconnect loop, the end of a
    # connect attempt included (where Python 3.11's wait_for dropped the cancel and the loop never ended).
    for i in range(40):
        remote = RemoteEngine(f"ws://127.0.0.1:{free_port()}", backoff_s=(0.0005, 0.001))
        remote.prewarm()
        await asyncio.sleep(0.01 + (i % 7) * 0.002)
        await closed_promptly(remote)
        assert remote.health()["status"] == "closed"


async def test_a_remote_engine_closes_promptly_while_a_listener_never_answers_its_handshake() -> None:
    with socket.socket() as listener:  # accepts connections in the kernel's backlog, never answers them
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        remote = RemoteEngine(f"ws://127.0.0.1:{listener.getsockname()[1]}", connect_timeout_s=30)
        starting = asyncio.ensure_future(remote.start())
        await asyncio.sleep(0.3)
        await closed_promptly(remote)
        with pytest.raises((EngineClosedError, EngineError)):
            await asyncio.wait_for(starting, 1)
