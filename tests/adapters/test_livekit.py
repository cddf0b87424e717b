"""The LiveKit TTS adapter with the real livekit-agents classes and a real engine (synthetic tokens, tiny SNAC).

Audio format, segments, metrics, options, error mapping and worker set-up. Timeouts, retries, failover,
cancellation, admission and many event loops: test_livekit_contract.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
from livekit.agents import APIConnectionError, APIConnectOptions, APIError, APIStatusError, Plugin
from livekit.agents.metrics import TTSMetrics
from livekit.agents.tts import SynthesizedAudio, TTSError

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.backends.protocol import FinishReason
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.spec import SAMPLE_RATE
from tests.stubs import started

STORY = "Once upon a time there was a tiny model. It spoke in random noise. Everyone listened anyway."


def _module_engine(config: EngineConfig) -> Iterator[OrpheusEngine]:
    """An engine for a module's tests; each test runs on its own event loop, the engine on its own thread."""
    engine = OrpheusEngine(config)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module", params=[0.0, 300.0], ids=["fast-generation", "paced-generation"])
def engine(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> Iterator[OrpheusEngine]:
    """Synthetic tokens unpaced (generation ahead of decoding, as on a GPU) or at 300/s a stream (3.6x real time).

    Utterances are a third of the synthetic backend's usual length, to keep the paced runs short.
    """
    synthetic = SyntheticConfig(tokens_per_second=request.param, frames_per_prompt_token=0.5)
    yield from _module_engine(replace(synthetic_config, synthetic=synthetic))


def _pcm(events: list[SynthesizedAudio]) -> np.ndarray:
    return np.frombuffer(b"".join(ev.frame.data.tobytes() for ev in events), dtype="<i2")


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Same audio up to float rounding (the decoder's batching and chunking vary from run to run)."""
    return a.size == b.size and np.abs(a.astype(int) - b).max() <= 2


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def _next_event(stream: AsyncIterator[SynthesizedAudio]) -> SynthesizedAudio:
    """The stream's next event; fails instead of hanging."""
    return await asyncio.wait_for(stream.__anext__(), 10)


async def test_a_fine_tuned_voice_and_an_adapter_speak_with_their_adapter(hf_lora_config: EngineConfig) -> None:
    engine = OrpheusEngine(hf_lora_config)
    await engine.start()
    try:
        for tts, voice in ((orpheus.TTS(engine=engine, voice="maya", seed=3), "maya"),
                           (orpheus.TTS(engine=engine, voice="tara", adapter="x", seed=3), "tara")):  # fmt: skip
            assert tts.adapter == "x"
            got = _pcm([ev async for ev in tts.synthesize("Hi there.")])
            reference = [c.pcm async for c in engine.synthesize("Hi there.", voice=voice, adapter="x", seed=3)]
            assert _close(got, np.frombuffer(b"".join(reference), "<i2"))
        tts.update_options(adapter=None)
        assert tts.adapter is None
        with pytest.raises(ValueError, match="unknown adapter 'nope'"):
            tts.update_options(adapter="nope")
        assert tts.adapter is None
    finally:
        await engine.aclose()


# ---------------------------------------------------------------------------------------------- synthesize()
async def test_a_cloned_voice_is_taken_by_name_like_a_stock_one(engine: OrpheusEngine) -> None:
    rng = np.random.default_rng(5)
    engine.add_voice("clone-lk", audio=0.1 * rng.standard_normal(24_000), transcript="A voice of my own.")
    try:
        tts = orpheus.TTS(engine=engine, voice="clone-lk", seed=3)
        assert tts.voice == "clone-lk"
        got = _pcm([ev async for ev in tts.synthesize(STORY)])
        reference = [c.pcm async for c in engine.synthesize(STORY, voice="clone-lk", seed=3)]
        assert _close(got, np.frombuffer(b"".join(reference), "<i2"))
    finally:
        engine.remove_voice("clone-lk")


async def test_synthesize_yields_24k_mono_frames_ending_final(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine, voice="tara", seed=3)
    assert (tts.sample_rate, tts.num_channels, tts.capabilities.streaming) == (SAMPLE_RATE, 1, True)
    events = [ev async for ev in tts.synthesize(STORY)]
    assert len(events) > 2
    assert all(ev.frame.sample_rate == SAMPLE_RATE and ev.frame.num_channels == 1 for ev in events)
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert len({ev.request_id for ev in events}) == 1
    reference = np.frombuffer(b"".join([c.pcm async for c in engine.synthesize(STORY, voice="tara", seed=3)]), "<i2")
    assert _close(_pcm(events), reference)  # the engine's audio for this request, all of it
    assert engine.stats()["active_streams"] == 0


async def test_synthesize_reports_ttfb_metrics(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    events = [ev async for ev in tts.synthesize("Metrics, please.")]
    await _until(lambda: bool(metrics))
    (m,) = metrics
    assert 0 < m.ttfb < m.duration
    assert m.audio_duration == pytest.approx(sum(ev.frame.duration for ev in events))
    assert not m.streamed and m.characters_count == len("Metrics, please.")


# ---------------------------------------------------------------------------------------------- stream()
async def test_stream_with_pushed_text_flush_and_end_yields_one_final_segment(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine, voice="leah")
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    started = engine.stats()["streams_started"]
    async with tts.stream() as stream:
        for word in STORY.split(" "):  # as an LLM streams it: word by word
            stream.push_text(word + " ")
        stream.flush()
        stream.end_input()
        events = [ev async for ev in stream]
    assert _pcm(events).size > SAMPLE_RATE
    assert all(ev.frame.sample_rate == SAMPLE_RATE and ev.frame.num_channels == 1 for ev in events)
    assert len({ev.segment_id for ev in events}) == 1
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert engine.stats()["streams_started"] - started == 3  # one engine request per sentence
    await _until(lambda: bool(metrics))
    assert metrics[0].streamed and 0 < metrics[0].ttfb < metrics[0].duration
    assert engine.stats()["active_streams"] == 0


async def test_stream_flush_ends_the_segment_without_end_input(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine)
    async with tts.stream() as stream:
        stream.push_text("Speak this part now, before the input ends.")
        stream.flush()
        events = [await _next_event(stream)]
        while not events[-1].is_final:
            events.append(await _next_event(stream))
    assert _pcm(events).size > 0


async def test_stream_without_text_yields_nothing(engine: OrpheusEngine) -> None:
    async with orpheus.TTS(engine=engine).stream() as stream:
        stream.end_input()
        assert [ev async for ev in stream] == []


# ---------------------------------------------------------------------------------------------- options
async def test_update_options_applies_to_later_requests_and_rejects_bad_values(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine, seed=5)
    assert tts.voice == "tara" and tts.provider == "orpheus"
    first = _pcm([ev async for ev in tts.synthesize("Same words.")])
    tts.update_options(seed=6, voice="leo")
    assert tts.voice == "leo"
    other = _pcm([ev async for ev in tts.synthesize("Same words.")])
    tts.update_options(seed=5, voice=None)
    again = _pcm([ev async for ev in tts.synthesize("Same words.")])
    assert _close(first, again) and not _close(first[: other.size], other[: first.size])
    with pytest.raises(ValueError, match="valid voices"):
        tts.update_options(voice="nobody")
    with pytest.raises(ValueError, match="temperature"):
        tts.update_options(temperature=-1.0)
    assert tts.voice == "tara"
    with pytest.raises(ValueError, match="valid voices"):
        orpheus.TTS(engine=engine, voice="nobody")
    with pytest.raises(ValueError, match="either engine or config"):
        orpheus.TTS(engine=engine, config=engine.config)


async def test_prewarm_returns_at_once_and_loads_the_engine(synthetic_config: EngineConfig) -> None:
    engine = OrpheusEngine(synthetic_config)
    try:
        tts = orpheus.TTS(engine=engine)
        tts.prewarm()
        assert not engine.started  # returned before loading ended: the loop was never held up by it
        await _until(lambda: engine.started, timeout=30)
    finally:
        await engine.aclose()


def test_config_selects_the_process_wide_engine(synthetic_config: EngineConfig) -> None:
    a, b = orpheus.TTS(config=synthetic_config), orpheus.TTS(config=synthetic_config)
    assert a.engine is b.engine is OrpheusEngine.shared(synthetic_config)


# ---------------------------------------------------------------------------------------------- errors
def _errors(tts: orpheus.TTS) -> list[TTSError]:
    errors: list[TTSError] = []
    tts.on("error", errors.append)
    return errors


async def test_bad_input_is_not_retried(engine: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=engine)
    errors = _errors(tts)
    with pytest.raises(APIStatusError) as exc_info:
        await tts.synthesize(b"not text").collect()  # type: ignore[arg-type]
    assert not exc_info.value.retryable and exc_info.value.status_code == 400
    assert [e.recoverable for e in errors] == [False]  # failed once, no retries


class _FailingBackend(SyntheticBackend):
    """A backend whose every request fails after a few tokens."""

    def _step(self, states: list) -> list:
        return [([], FinishReason.ERROR) if st["i"] > 14 else out for st, out in zip(states, super()._step(states))]


async def test_backend_failure_is_a_retryable_connection_error(synthetic_config: EngineConfig) -> None:
    async with started(synthetic_config, backend=_FailingBackend()) as engine:
        tts = orpheus.TTS(engine=engine)
        errors = _errors(tts)
        with pytest.raises(APIConnectionError) as exc_info:
            await tts.synthesize(STORY, conn_options=APIConnectOptions(max_retry=1, retry_interval=0)).collect()
        assert exc_info.value.retryable
        assert [e.recoverable for e in errors] == [True, False]  # retried once, then gave up


async def test_a_closed_engine_is_not_retried(synthetic_config: EngineConfig) -> None:
    async with started(synthetic_config) as engine:
        pass
    tts = orpheus.TTS(engine=engine)
    errors = _errors(tts)
    with pytest.raises(APIError) as exc_info:
        await tts.synthesize(STORY, conn_options=APIConnectOptions(max_retry=2, retry_interval=0)).collect()
    assert not exc_info.value.retryable and "closed" in str(exc_info.value)
    assert [e.recoverable for e in errors] == [False]


# ---------------------------------------------------------------------------------------------- worker set-up
def test_plugin_is_registered_on_import() -> None:
    assert any(isinstance(p, orpheus.OrpheusPlugin) for p in Plugin.registered_plugins)


def test_download_files_fetches_the_hub_weights_of_used_configs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import huggingface_hub

    fetched: list[str] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: fetched.append(repo))
    orpheus.download_files()
    assert fetched == ["canopylabs/orpheus-3b-0.1-ft", "hubertsiuzdak/snac_24khz"]
    fetched.clear()
    orpheus.download_files(EngineConfig(model="me/orpheus-ft", snac=str(tmp_path)))  # local SNAC: nothing to fetch
    assert fetched == ["me/orpheus-ft"]
    fetched.clear()
    remote = EngineConfig(model="http://gpu-pool:8000/v1", backend="remote", tokenizer="me/orpheus-tok")
    orpheus.TTS(config=remote)
    orpheus.OrpheusPlugin().download_files()  # what `download-files` runs: every config this process uses
    assert "me/orpheus-tok" in fetched and not any(r.startswith("http") for r in fetched)
