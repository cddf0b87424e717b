"""`POST /v1/audio/speech` as OpenAI's clients use it: every `response_format` streamed with OpenAI's Content-Type and
decoded back to the engine's audio, `stream_format: sse`, `speed`, `instructions`, OpenAI's voice names."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import av
import numpy as np
import pytest

from orpheus_tts_plugin import AudioChunk, EngineConfig, EngineError, OrpheusEngine, Speech
from orpheus_tts_plugin.backends import make_tokenizer
from orpheus_tts_plugin.server.policy import Policy
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.prompt import prompt_ids
from tests.served import TEXT, assert_same_audio, engine_of, pcm_of, serving


@pytest.fixture
def one_pace(config: EngineConfig) -> None:
    """Skip the paced run of a test of the route's own work (the engine behaves alike at both paces: the format and
    SSE tests run at both)."""
    if config.synthetic.tokens_per_second:
        pytest.skip("one pace is enough: this is the route's work, not the engine's")


@pytest.fixture(scope="module")
def served(config: EngineConfig) -> Iterator[ServerThread]:
    """The module's server, run as `serve --voice-alias shimmer=leo` would (over the default table's zoe)."""
    with serving(config, policy=Policy(voice_aliases={"shimmer": "leo"})) as srv:
        yield srv


CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
# Samples a lossy format may add or drop at the ends: encoder priming and the last frame's padding (at 24 kHz:
# libmp3lame's 1105 + a 1152 frame, aac's 1024 + a 1024 frame, opus's 20 ms frame; flac and wav are exact).
SLACK = {"mp3": 2 * 1152 + 1105, "aac": 3 * 1024, "opus": 960 * 2, "flac": 0, "wav": 0}


def decoded(body: bytes, fmt: str) -> np.ndarray:
    """The audio of an encoded body, decoded by PyAV (ffmpeg) as int16 mono at 24 kHz."""
    if fmt == "pcm":
        return np.frombuffer(body, dtype="<i2")
    container = {"opus": "ogg", "aac": "aac"}.get(fmt, fmt)
    with av.open(io.BytesIO(body), format=container) as source:
        stream = source.streams.audio[0]
        assert stream.codec_context.channels == 1
        # Opus always decodes at 48 kHz (RFC 7845); its header keeps the 24 kHz it was encoded from.
        assert stream.codec_context.sample_rate == (48_000 if fmt == "opus" else SAMPLE_RATE)
        resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
        pieces = [f.to_ndarray().reshape(-1) for frame in source.decode(stream) for f in resampler.resample(frame)]
    return np.concatenate(pieces).astype(np.int16)


def assert_decodes_to(got: np.ndarray, reference: np.ndarray, fmt: str) -> None:
    """`got` is `reference` within what `fmt` loses: exact for lossless formats, else the same length within the
    codec's priming and padding (the test model's audio is noise, whose waveform a perceptual codec does not keep:
    `test_each_lossy_encoder_keeps_a_voice_like_signal` checks the waveform)."""
    if fmt in ("flac", "wav", "pcm"):
        assert_same_audio(got, reference)
        return
    assert abs(got.size - reference.size) <= SLACK[fmt], (got.size, reference.size)


def voice_like(seconds: float = 2.0) -> np.ndarray:
    """A voiced sound: a 140 Hz pulse train's harmonics under a 4 Hz syllable envelope, as int16."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    harmonics = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 20))
    return (6000 * harmonics * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t))).astype(np.int16)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_each_lossy_encoder_keeps_a_voice_like_signal(fmt: str) -> None:
    from orpheus_tts_plugin.server.encoders import FORMATS, Encoder

    sent = voice_like()
    encoder = Encoder(FORMATS[fmt])
    pieces, at = [], 0
    for size in [3435] + [2048] * (sent.size // 2048):  # the engine's first chunk, then a frame a chunk
        pieces.append(encoder.encode(sent[at : at + size].tobytes()))
        at += size
    got = decoded(b"".join(pieces) + encoder.finish(), fmt).astype(np.float64)
    assert abs(got.size - sent.size) <= SLACK[fmt], (got.size, sent.size)
    ref = sent.astype(np.float64)
    n = min(sent.size, got.size) - SLACK[fmt]
    size = 2 * got.size
    shifted = np.fft.irfft(np.fft.rfft(got, size) * np.conj(np.fft.rfft(ref[:n], size)), size)
    lag = int(np.argmax(shifted[: SLACK[fmt] + 1]))  # the codec's delay
    assert np.corrcoef(ref[:n], got[lag : lag + n])[0, 1] > 0.95


async def post(served: ServerThread, **body: object) -> tuple[dict[str, str], bytes]:
    """(headers, body) of a streamed request through the openai SDK's raw response."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0)
    try:
        async with client.audio.speech.with_streaming_response.create(
            model="orpheus", input=TEXT, extra_body={"seed": 3}, **body
        ) as response:
            return dict(response.headers), b"".join([piece async for piece in response.iter_bytes()])
    finally:
        await client.close()


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
@pytest.mark.usefixtures("one_pace")
async def test_the_openai_sdk_gets_each_format_streamed_with_openais_content_type_and_the_engines_audio(
    served: ServerThread, fmt: str
) -> None:
    headers, body = await post(served, voice="tara", response_format=fmt)
    assert headers["content-type"] == CONTENT_TYPES[fmt] and headers.get("transfer-encoding") == "chunked"
    if fmt == "wav":
        assert body[:4] == b"RIFF" and int.from_bytes(body[24:28], "little") == SAMPLE_RATE
    assert_decodes_to(decoded(body, fmt), await pcm_of(engine_of(served), voice="tara", seed=3), fmt)


async def test_no_response_format_is_mp3_as_openai_has_it(served: ServerThread) -> None:
    headers, body = await post(served, voice="tara")
    assert headers["content-type"] == "audio/mpeg"
    assert_decodes_to(decoded(body, "mp3"), await pcm_of(engine_of(served), voice="tara", seed=3), "mp3")


async def sse_events(served: ServerThread, **body: object) -> list[dict[str, Any]]:
    """The events of an SSE speech request, as the openai SDK's own SSE reader parses them (it raises APIError at an
    `error` event)."""
    from openai import AsyncOpenAI, AsyncStream

    client = AsyncOpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0)
    request = {"model": "orpheus", "input": TEXT, "seed": 3, "stream_format": "sse", **body}
    try:
        events = await client.post(
            "/audio/speech", cast_to=object, body=request, stream=True, stream_cls=AsyncStream[dict[str, Any]]
        )
        return [event async for event in events]
    finally:
        await client.close()


async def test_sse_sends_base64_audio_deltas_then_one_done_with_usage(served: ServerThread) -> None:
    headers, body = await post(served, voice="tara", response_format="flac", stream_format="sse")
    assert headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 2
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert_decodes_to(decoded(audio, "flac"), await pcm_of(engine_of(served), voice="tara", seed=3), "flac")


async def test_sse_usage_counts_the_prompts_ids_and_the_generated_ids(served: ServerThread) -> None:
    engine = engine_of(served)
    # At speed 2 the audio's samples say half the tokens: usage must not be read off the audio.
    events = await sse_events(served, voice="tara", response_format="pcm", speed=2.0)
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    generated: list[int] = []
    speech = engine.synthesize(TEXT, voice="tara", seed=3, token_log=generated)
    assert [c async for c in speech][-1].final
    tokenizer = make_tokenizer(engine.config)  # the engine's own
    prompts = sum(len(prompt_ids(tokenizer, engine.spec, text, "tara")) for text in speech.sentences)
    usage = {"input_tokens": prompts, "output_tokens": len(generated), "total_tokens": prompts + len(generated)}
    assert events[-1]["usage"] == usage == speech.usage.as_dict()  # every id made, end-of-speech ids included


def fail_after_first_chunk(engine: OrpheusEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, each stream of `engine` fails after its first chunk, as one whose engine faults mid-stream."""
    speak = engine.synthesize

    def synthesize(*args: Any, **kwargs: Any) -> Speech:
        speech = speak(*args, **kwargs)

        async def chunks() -> AsyncGenerator[AudioChunk, None]:
            async with contextlib.aclosing(speech):
                yield await anext(speech)
                raise EngineError("injected: the engine failed mid-stream")

        return Speech(speech.sentences, chunks(), usage=speech.usage)

    monkeypatch.setattr(engine, "synthesize", synthesize)


@pytest.mark.usefixtures("one_pace")
async def test_an_engine_failure_mid_sse_ends_it_with_openais_error_event(
    served: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openai import APIError

    fail_after_first_chunk(engine_of(served), monkeypatch)
    headers, body = await post(served, voice="tara", response_format="pcm", stream_format="sse")
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
    assert events[-1]["error"] == {
        "message": "injected: the engine failed mid-stream",
        "type": "server_error",
        "param": None,
        "code": "EngineError",
    }
    with pytest.raises(APIError, match="injected: the engine failed mid-stream"):
        await sse_events(served, voice="tara", response_format="pcm")


@pytest.mark.usefixtures("one_pace")
async def test_an_engine_failure_mid_audio_ends_the_body_truncated_which_the_openai_sdk_raises(
    served: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_after_first_chunk(engine_of(served), monkeypatch)
    with pytest.raises(Exception, match="incomplete chunked read") as raised:  # noqa: PT011 - the SDK's HTTP library's
        await post(served, voice="tara", response_format="pcm")
    assert type(raised.value).__name__ == "RemoteProtocolError"  # httpx's (openai < 3) or httpx2's


@pytest.mark.usefixtures("one_pace")
async def test_instructions_are_accepted_ignored_and_said_so_in_a_header(served: ServerThread) -> None:
    headers, body = await post(served, voice="tara", response_format="pcm", instructions="Speak cheerfully.")
    assert headers["x-orpheus-instructions"].startswith("ignored")
    assert_same_audio(decoded(body, "pcm"), await pcm_of(engine_of(served), voice="tara", seed=3))


@pytest.mark.parametrize("openai_voice, voice", [("alloy", "tara"), ("shimmer", "leo")], ids=["table", "flag"])
@pytest.mark.usefixtures("one_pace")
async def test_an_openai_voice_name_speaks_with_the_voice_its_alias_names(
    served: ServerThread, openai_voice: str, voice: str
) -> None:
    _, body = await post(served, voice=openai_voice, response_format="pcm")
    assert_same_audio(decoded(body, "pcm"), await pcm_of(engine_of(served), voice=voice, seed=3))


@pytest.mark.usefixtures("one_pace")
async def test_speed_stretches_the_audio_as_the_engine_does(served: ServerThread) -> None:
    _, body = await post(served, voice="tara", response_format="pcm", speed=2.0)
    fast = decoded(body, "pcm")
    normal = await pcm_of(engine_of(served), voice="tara", seed=3)
    in_process = await pcm_of(engine_of(served), voice="tara", seed=3, speed=2.0)
    # WSOLA's splice points follow the audio, which the decoder's batching moves by a step or two.
    assert abs(fast.size - in_process.size) <= 2 * 480 and abs(fast.size - normal.size / 2) <= 0.02 * normal.size


def test_serve_voice_alias_flags_become_the_policys_aliases_and_a_malformed_one_is_refused() -> None:
    from orpheus_tts_plugin.cli import build_parser
    from orpheus_tts_plugin.server.serve import policy

    args = ["serve", "--voice-alias", "alloy=leo", "--voice-alias", "boss=dan"]
    assert dict(policy(build_parser().parse_args(args)).voice_aliases) == {"alloy": "leo", "boss": "dan"}
    with pytest.raises(ValueError, match="--voice-alias takes KEY=VALUE"):
        policy(build_parser().parse_args(["serve", "--voice-alias", "alloy"]))
