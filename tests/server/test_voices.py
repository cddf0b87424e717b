"""`/v1/voices` of `orpheus-tts serve`: a cloned voice uploaded (guarded by the key), listed, spoken through a
RemoteEngine already connected before the upload, removed; bad uploads refused in one line; servers sharing a
voices folder (`--voices-dir`) all speaking a voice added on one of them, a server started later too, and a
removal reaching them all."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, RemoteEngine
from orpheus_tts_plugin.server.policy import Policy
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.server.voice_store import DirectoryVoiceStore
from orpheus_tts_plugin.spec import ENGLISH, SAMPLE_RATE
from tests.served import assert_same_audio, engine_of, pcm_of, serving, until

KEY = "voice-key"
TRANSCRIPT = "This is how I sound."


@pytest.fixture(scope="module")
def guarded(config: EngineConfig) -> Iterator[ServerThread]:
    with serving(config, policy=Policy(api_keys=frozenset({KEY}))) as srv:
        yield srv


def pcm16(seconds: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (3000 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype("<i2")


def wav_bytes(pcm: np.ndarray, rate: int = SAMPLE_RATE) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def call(srv: ServerThread, method: str, path: str, body: dict | None = None, key: str | None = KEY):
    """(status, parsed JSON or None) of one HTTP request."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.http_url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_an_uploaded_voice_is_listed_and_spoken_through_a_remote_engine_connected_before(
    guarded: ServerThread,
) -> None:
    remote = RemoteEngine(guarded.url, api_key=KEY)
    await remote.start()
    try:
        with pytest.raises(ValueError, match="unknown voice 'ana'"):
            remote.check_options(voice="ana")
        status, voice = call(
            guarded, "POST", "/v1/voices", {"name": "ana", "transcript": TRANSCRIPT, "wav": b64(wav_bytes(pcm16()))}
        )
        assert status == 201, voice
        assert voice["name"] == "ana" and voice["kind"] == "cloned" and voice["seconds"] == 1.0
        assert voice["prompt_ids"] > 7 * 12  # encoded at upload: the server had started
        status, body = call(
            guarded,
            "POST",
            "/v1/voices",
            {"name": "bob", "transcript": TRANSCRIPT, "pcm": b64(pcm16(seed=1).tobytes())},
        )
        assert status == 201, body
        status, listing = call(guarded, "GET", "/v1/voices")
        assert status == 200 and listing["default_voice"] == ENGLISH.default_voice
        assert [v["name"] for v in listing["voices"]] == [*ENGLISH.voices, "ana", "bob"]

        await until(lambda: _knows(remote, "ana"))
        got = await pcm_of(remote, voice="ana", seed=4)
        assert_same_audio(got, await pcm_of(engine_of(guarded), voice="ana", seed=4))
        assert not np.array_equal(got, await pcm_of(engine_of(guarded), voice="tara", seed=4))

        late = RemoteEngine(guarded.url, api_key=KEY)  # a client that connects after: the hello lists it
        await late.start()
        assert {"ana", "bob"} <= set(late.spec.voices)
        await late.aclose()

        assert call(guarded, "DELETE", "/v1/voices/bob")[0] == 204
        status, body = call(guarded, "DELETE", "/v1/voices/bob")
        assert status == 404 and "no added voice 'bob'" in body["error"]["message"]
        await until(lambda: not _knows(remote, "bob"))
    finally:
        await remote.aclose()
        for name in ("ana", "bob"):
            call(guarded, "DELETE", f"/v1/voices/{name}")


def _knows(remote: RemoteEngine, voice: str) -> bool:
    try:
        remote.check_options(voice=voice)
    except ValueError:
        return False
    return True


def test_the_voice_routes_need_the_key(guarded: ServerThread) -> None:
    body = {"name": "eve", "transcript": TRANSCRIPT, "pcm": b64(pcm16().tobytes())}
    for method, path, payload in (
        ("GET", "/v1/voices", None),
        ("POST", "/v1/voices", body),
        ("DELETE", "/v1/voices/eve", None),
    ):
        for key in (None, "wrong"):
            status, answer = call(guarded, method, path, payload, key=key)
            assert status == 401 and answer["error"]["type"] == "authentication_error"
    assert "eve" not in engine_of(guarded).spec.voices


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"name": "tara", "transcript": TRANSCRIPT, "pcm": b64(pcm16().tobytes())}, "is a stock voice"),
        ({"name": "eve", "transcript": "", "pcm": b64(pcm16().tobytes())}, "transcript is empty"),
        ({"name": "eve", "transcript": TRANSCRIPT}, "exactly one of 'wav' or 'pcm'"),
        ({"name": "eve", "transcript": TRANSCRIPT, "pcm": "not base64!"}, "not valid base64"),
        ({"name": "eve", "transcript": TRANSCRIPT, "pcm": b64(b"\x00" * 3)}, "whole int16 samples"),
        ({"name": "eve", "transcript": TRANSCRIPT, "pcm": b64(pcm16(0.05).tobytes())}, "shorter than one frame"),
        ({"name": "eve", "transcript": TRANSCRIPT, "wav": b64(wav_bytes(pcm16(), 16_000))}, "resample"),
        ({"name": "eve", "transcript": TRANSCRIPT, "pcm": "", "accent": "x"}, "unknown field"),
    ],
    ids=["stock-name", "no-transcript", "no-audio", "bad-base64", "odd-bytes", "too-short", "16k", "unknown-field"],
)
def test_a_bad_upload_is_a_400_in_one_line(guarded: ServerThread, body: dict, message: str) -> None:
    status, answer = call(guarded, "POST", "/v1/voices", body)
    assert status == 400 and message in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    assert "eve" not in engine_of(guarded).spec.voices


SHORT = 70  # max_tokens: at most 10 frames an utterance, so that 8 streams at the paced rate end soon
MINE = {"name": "mine", "transcript": TRANSCRIPT, "pcm": b64(pcm16(seed=3).tobytes())}


async def test_a_voice_added_on_one_of_two_servers_sharing_a_folder_is_spoken_by_both_and_a_later_one(
    config: EngineConfig, tmp_path: Path
) -> None:
    folder = tmp_path / "voices"
    with (
        serving(config, voice_store=DirectoryVoiceStore(folder)) as one,
        serving(config, voice_store=DirectoryVoiceStore(folder)) as two,
    ):
        remote = RemoteEngine([one.url, two.url])
        await remote.start(every_server=True)
        try:
            status, body = call(one, "POST", "/v1/voices", MINE, key=None)
            assert status == 201, body
            await until(lambda: _knows(remote, "mine"))
            before = {srv.url: engine_of(srv).stats()["streams_started"] for srv in (one, two)}
            heard = await asyncio.gather(*(pcm_of(remote, voice="mine", seed=i, max_tokens=SHORT) for i in range(8)))
            assert all(pcm.size > 0 for pcm in heard)
            spread = {srv.url: engine_of(srv).stats()["streams_started"] - before[srv.url] for srv in (one, two)}
            assert all(n >= 1 for n in spread.values()) and sum(spread.values()) == 8, spread
            # The same reference, encoded on each server, speaks the same audio.
            assert_same_audio(await pcm_of(engine_of(two), voice="mine", seed=4, max_tokens=SHORT), heard[4])

            with serving(config, voice_store=DirectoryVoiceStore(folder)) as later:
                assert "mine" in engine_of(later).spec.voices  # from its first hello
                late = RemoteEngine(later.url)
                await late.start()
                assert_same_audio(await pcm_of(late, voice="mine", seed=4, max_tokens=SHORT), heard[4])
                await late.aclose()

                assert call(two, "DELETE", "/v1/voices/mine", key=None)[0] == 204  # removed on another server
                await until(lambda: all("mine" not in engine_of(s).spec.voices for s in (one, two, later)))
                await until(lambda: not _knows(remote, "mine"))
                status, body = call(later, "DELETE", "/v1/voices/mine", key=None)
                assert status == 404 and "no added voice 'mine'" in body["error"]["message"]
        finally:
            await remote.aclose()
    assert not list(folder.iterdir())
