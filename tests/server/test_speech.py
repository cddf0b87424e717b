"""`POST /v1/audio/speech`: the openai client's PCM, WAV, bad requests refused with 400, a closed response aborting its
request, 503 with Retry-After when overloaded."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from orpheus_tts_plugin import (
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
    pcm_of,
    until,
)


async def test_the_openai_client_streams_pcm_equal_to_the_in_process_audio(served: ServerThread) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=served.http_url + "/v1", api_key="unused")
    async with client.audio.speech.with_streaming_response.create(
        model="orpheus", voice="tara", input=TEXT, response_format="pcm", extra_body={"seed": 9}
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers.get("transfer-encoding") == "chunked"
        body = b"".join([piece async for piece in response.iter_bytes()])
    await client.close()
    assert_same_audio(np.frombuffer(body, dtype="<i2"), await pcm_of(engine_of(served), voice="tara", seed=9))


async def test_wav_is_a_header_then_the_same_pcm(served: ServerThread) -> None:
    status, body = await asyncio.to_thread(
        http, served, "/v1/audio/speech", {"model": "m", "input": TEXT, "seed": 2, "response_format": "wav"}
    )
    assert status == 200 and body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt "
    assert int.from_bytes(body[24:28], "little") == SAMPLE_RATE
    assert_same_audio(np.frombuffer(body[44:], dtype="<i2"), await pcm_of(engine_of(served), seed=2))


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"model": "m", "input": TEXT, "voice": "nosuch"}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "response_format": "ogg"}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "stream_format": "websocket"}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "speed": 4.5}, 400, "ValueError"),
        ({"model": "m", "input": TEXT, "speed": "fast"}, 400, "TypeError"),
        ({"model": "m", "input": TEXT, "temperature": "hot"}, 400, "TypeError"),
        ({"model": "m", "input": TEXT, "pitch": 2}, 400, "TypeError"),
        ({"input": TEXT}, 400, "TypeError"),
    ],
)
def test_bad_http_requests_are_refused_with_400_naming_the_field(
    served: ServerThread, body: dict, status: int, code: str
) -> None:
    got, raw = http(served, "/v1/audio/speech", body)
    error = json.loads(raw)["error"]
    assert got == status and error["code"] == code and error["type"] == "invalid_request_error"
    if body.get("speed") == 4.5:
        assert "[0.25, 4]" in error["message"]
    if body.get("voice") == "nosuch":
        assert "tara" in error["message"]


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_closing_the_http_response_aborts_the_engine_request_within_one_step(
    long_served: ServerThread, stream_format: str
) -> None:
    from openai import AsyncOpenAI

    before = engine_of(long_served).stats()["backend"].get("aborted", 0)
    client = AsyncOpenAI(base_url=long_served.http_url + "/v1", api_key="unused", max_retries=0)
    async with client.audio.speech.with_streaming_response.create(
        model="m",
        voice="tara",
        input=TEXT,
        response_format="pcm",
        stream_format=stream_format,
        extra_body={"max_tokens": 1_000_000},
    ) as response:
        async for _ in response.iter_bytes():
            break  # leaving the block closes the connection
    await client.close()
    await until(lambda: idle(long_served))
    backend = engine_of(long_served).stats()["backend"]
    assert backend["aborted"] == before + 1 and backend["max_steps_to_abort"] <= 1


async def test_an_overloaded_server_answers_503_with_retry_after(served: ServerThread, remote: RemoteEngine) -> None:
    long_text = " ".join([TEXT] * 2)

    async def hold() -> None:
        async for _ in remote.synthesize(long_text):
            pass

    holders = [asyncio.create_task(hold()) for _ in range(MAX_STREAMS)]
    await until(lambda: engine_of(served).load >= 1.0, 60)
    req = urllib.request.Request(
        served.http_url + "/v1/audio/speech", data=json.dumps({"model": "m", "input": TEXT}).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(urllib.request.urlopen, req, timeout=30)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
    assert json.loads(refused.value.read())["error"]["code"] == "EngineOverloadedError"
    await asyncio.gather(*holders)
