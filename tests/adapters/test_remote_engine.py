"""The framework adapters on a RemoteEngine: what works unchanged (Pipecat) and what LiveKit's adapter still needs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
from livekit.agents import APIConnectOptions
from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame, TTSUpdateSettingsFrame
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import run_test

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, RemoteEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread

PACES = {"fast": 0.0, "paced": 400.0}
TEXT = "Hello there, thanks for calling the test line today."


@pytest.fixture(scope="module", params=list(PACES))
def served(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[ServerThread]:
    engine = OrpheusEngine(replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=PACES[request.param])))
    with serving_in_thread(engine) as srv:
        asyncio.run(engine.start())
        yield srv


@pytest.fixture
async def remote(served: ServerThread) -> AsyncIterator[RemoteEngine]:
    engine = RemoteEngine(served.url)
    await engine.start()
    yield engine
    await engine.aclose()


async def reference(served: ServerThread, text: str = TEXT, **options: object) -> np.ndarray:
    """The server's own engine, in process: what every adapter must deliver."""
    pcm = b"".join([c.pcm async for c in served.service.engine.synthesize(text, **options)])
    return np.frombuffer(pcm, dtype="<i2")


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.size == want.size > 0 and np.abs(got.astype(np.int32) - want).max() <= 2


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------------------------- Pipecat
async def test_a_pipecat_pipeline_speaks_through_a_remote_engine_unchanged(
    served: ServerThread, remote: RemoteEngine
) -> None:
    service = OrpheusTTSService(engine=remote, settings=OrpheusTTSService.Settings(voice="leo", seed=3))
    down, up = await run_test(
        service,
        frames_to_send=[TTSSpeakFrame(TEXT)],
        pipeline_params=PipelineParams(audio_out_sample_rate=24_000),
        start_timeout=60,
    )
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and isinstance([f for f in down if isinstance(f, TTSStoppedFrame)][-1], TTSStoppedFrame)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    got = np.frombuffer(b"".join(f.audio for f in audio), dtype="<i2")
    assert_same_audio(got, await reference(served, voice="leo", seed=3))


async def test_a_pipecat_settings_update_is_checked_by_the_remote_engine(
    served: ServerThread, remote: RemoteEngine
) -> None:
    service = OrpheusTTSService(engine=remote, settings=OrpheusTTSService.Settings(seed=5))
    bad = TTSUpdateSettingsFrame(delta=OrpheusTTSService.Settings(voice="alloy"))
    down, up = await run_test(
        service,
        frames_to_send=[bad, TTSSpeakFrame(TEXT)],
        pipeline_params=PipelineParams(audio_out_sample_rate=24_000),
        start_timeout=60,
    )
    assert any("alloy" in f.error for f in up if isinstance(f, ErrorFrame))
    got = np.frombuffer(b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame)), dtype="<i2")
    assert_same_audio(got, await reference(served, seed=5))  # kept the current settings


# ---------------------------------------------------------------------------------------------- LiveKit
async def test_livekit_tts_speaks_through_a_remote_engine(served: ServerThread, remote: RemoteEngine) -> None:
    tts = orpheus.TTS(engine=remote, voice="zoe", seed=7)
    events = [ev async for ev in tts.synthesize(TEXT, conn_options=APIConnectOptions(max_retry=0))]
    got = np.frombuffer(b"".join(ev.frame.data.tobytes() for ev in events), dtype="<i2")
    assert_same_audio(got, await reference(served, voice="zoe", seed=7))
    assert tts.model == "serve" and tts.voice == "zoe"
    assert 0.0 <= orpheus.engine_load_fnc(remote)(type("Server", (), {"active_jobs": []})()) < 1.0
    stream = tts.stream()
    stream.push_text(" ".join([TEXT] * 3))
    stream.end_input()
    await asyncio.wait_for(stream.__anext__(), 30)
    await stream.aclose()  # what LiveKit does on interruption: the server's request is aborted
    engine = served.service.engine
    await until(lambda: engine.stats()["active_streams"] == 0 and engine.stats()["backend"]["live_requests"] == 0)
    assert engine.stats()["backend"]["max_steps_to_abort"] <= 1
