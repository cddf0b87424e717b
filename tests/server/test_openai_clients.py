"""The OpenAI speech clients users already have, pointed at `orpheus-tts serve` unchanged: LiveKit's
`livekit.plugins.openai.TTS` (its defaults: gpt-4o-mini-tts over SSE in mp3 with voice "ash"; and tts-1 with pcm),
through `synthesize()` and `stream()`, and Pipecat's `OpenAITTSService` in a real pipeline (an OpenAI voice name, a
speed). Each decodes the audio itself (LiveKit with PyAV); the sample count is checked against the engine's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orpheus_tts_plugin import EngineConfig, SyntheticConfig
from orpheus_tts_plugin.server.serve import ServerThread
from orpheus_tts_plugin.spec import SAMPLE_RATE
from tests.served import MAX_STREAMS, TEXT, engine_of, pcm_of
from tests.server.test_openai_formats import SLACK


@pytest.fixture(scope="module")
def config(synthetic_config: EngineConfig) -> EngineConfig:
    """One pace only: what these tests prove is the clients' side (both paces of the route: test_openai_formats.py)."""
    return replace(synthetic_config, max_streams=MAX_STREAMS, synthetic=SyntheticConfig(tokens_per_second=0.0))


@pytest.mark.parametrize("how", ["synthesize", "stream"])
@pytest.mark.parametrize("model, fmt", [("gpt-4o-mini-tts", None), ("tts-1", "pcm")], ids=["defaults", "tts-1-pcm"])
async def test_livekits_openai_tts_speaks_through_the_server(
    served: ServerThread, model: str, fmt: str | None, how: str
) -> None:
    from livekit.agents import tokenize, tts
    from livekit.plugins import openai

    options = {"response_format": fmt} if fmt else {}
    # "ash" is the plugin's default voice: an OpenAI name the server maps onto one of Orpheus's ("leo").
    lk = openai.TTS(base_url=served.http_url + "/v1", api_key="unused", model=model, **options)
    try:
        if how == "synthesize":
            events = [ev async for ev in lk.synthesize(TEXT)]
        else:
            streaming = tts.StreamAdapter(tts=lk, sentence_tokenizer=tokenize.blingfire.SentenceTokenizer())
            async with streaming.stream() as stream:
                stream.push_text(TEXT)
                stream.end_input()
                events = [ev async for ev in stream]
    finally:
        await lk.aclose()
    assert events and all(ev.frame.sample_rate == SAMPLE_RATE and ev.frame.num_channels == 1 for ev in events)
    got = sum(ev.frame.samples_per_channel for ev in events)
    reference = (await pcm_of(engine_of(served), voice="leo")).size  # unseeded: the length is the text's
    # LiveKit's AudioEmitter ends each segment on whole frames (silence-padded): up to 20 ms a sentence.
    slack = SLACK["mp3"] if fmt is None else 480 * len(engine_of(served).sentences(TEXT))
    assert abs(got - reference) <= slack, (got, reference)


async def test_pipecats_openai_tts_service_speaks_through_the_server_in_a_pipeline(served: ServerThread) -> None:
    from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    service = OpenAITTSService(
        base_url=served.http_url + "/v1",
        api_key="unused",
        settings=OpenAITTSService.Settings(voice="nova", speed=1.5),  # Pipecat refuses any voice but OpenAI's
    )
    down, _ = await run_test(service, frames_to_send=[TTSSpeakFrame(TEXT)], start_timeout=60)
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    # Pipecat sends no seed: the audio differs run to run, and the stretch's length by a few of its 20 ms frames.
    normal = (await pcm_of(engine_of(served), voice="jess")).size
    assert abs(len(audio) // 2 - normal / 1.5) <= 2 * 480 * len(engine_of(served).sentences(TEXT))
