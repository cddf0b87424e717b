"""A cloned voice on backend="vllm" (vLLM's CPU build): its reference turn leads every prompt and is served again
from vLLM's prefix cache (`RequestOutput.num_cached_tokens`, summed in the backend's `cached_prompt_tokens`).

vLLM caches whole KV blocks only: a hit covers the reference turn rounded down to `cache_config.block_size` (128 on
the CPU build). The reference is 5 s (59 frames, 413 audio ids) so that the turn spans several blocks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.speech.prompt import reference_prompt
from orpheus_tts_plugin.speech.voices import encode_frames
from tests.test_voices import TRANSCRIPT, voice_audio

TEXT = "Hello from a cloned voice."
SHORT = {"max_tokens": 140}  # 20 frames: enough audio, little decode time


@pytest.fixture(scope="module")
async def engine(vllm_config: EngineConfig):
    eng = OrpheusEngine(vllm_config)
    await eng.start()
    requests: list = []
    generate = eng._backend.generate

    def recording(req: Any) -> Any:
        requests.append(req)
        return generate(req)

    eng._backend.generate = recording  # every GenerationRequest the engine sends to vLLM
    eng.requests = requests  # type: ignore[attr-defined]
    yield eng
    await eng.aclose()


def pcm(chunks: list) -> np.ndarray:
    return np.frombuffer(b"".join(c.pcm for c in chunks), dtype="<i2")


def cached(engine: OrpheusEngine) -> int:
    return engine.stats()["backend"]["cached_prompt_tokens"]


def block_size(engine: OrpheusEngine) -> int:
    return engine._backend._engine.vllm_config.cache_config.block_size


async def timed(engine: OrpheusEngine, voice: str, **kwargs: Any) -> tuple[list, list[int], int, float]:
    """One utterance: its chunks, generated ids, the prompt ids vLLM's cache served, seconds to the first chunk."""
    log: list[int] = []
    before, t0 = cached(engine), time.perf_counter()
    first: list[float] = []
    chunks = []
    async for chunk in engine.synthesize(TEXT, voice=voice, token_log=log, **kwargs):
        first = first or [time.perf_counter() - t0]
        chunks.append(chunk)
    return chunks, log, cached(engine) - before, first[0]


async def test_a_cloned_voice_speaks_on_vllm_and_its_second_request_reuses_the_reference_from_the_prefix_cache(
    engine: OrpheusEngine, test_model_dir: Path
) -> None:
    audio = voice_audio(5.0, seed=1)
    engine.add_voice("ana", audio=audio, transcript=TRANSCRIPT)
    frames = encode_frames(load_snac(str(test_model_dir / "snac")), audio)
    reference = reference_prompt(engine._tokenizer, ENGLISH, TRANSCRIPT, frames)
    assert len(frames) == 59 and len(reference) > 413

    n = len(engine.requests)
    chunks1, _, cached1, ttfa1 = await timed(engine, "ana", seed=5, **SHORT)
    chunks2, _, cached2, ttfa2 = await timed(engine, "ana", seed=6, **SHORT)
    reqs = engine.requests[n:]
    assert len(reqs) == 2  # one sentence each
    for req in reqs:
        assert req.prompt_ids[: len(reference)] == reference and req.prefix_len == len(reference)
    for chunks in (chunks1, chunks2):
        assert chunks[-1].final and pcm(chunks).size > 0 and np.abs(pcm(chunks)).max() > 0

    block = block_size(engine)
    assert cached1 == 0  # the voice's first request: nothing of it in the cache yet
    assert cached2 >= len(reference) // block * block > 0  # the reference turn's whole blocks, from the cache
    assert cached2 % block == 0 and cached2 < len(reqs[1].prompt_ids)
    assert not any(k.startswith("invalid_") and v for k, v in engine.stats().items())
    print(
        f"\nreference turn {len(reference)} ids, prompt {len(reqs[1].prompt_ids)} ids, block {block}: "
        f"cached {cached1} then {cached2}; first audio {ttfa1 * 1000:.0f} ms then {ttfa2 * 1000:.0f} ms"
    )


@pytest.mark.parametrize(
    ("name", "sampling", "audio_seed"),
    [("ben", {"seed": 11}, 2), ("cy", {"temperature": 0.0}, 3)],
    ids=["seeded", "greedy"],
)
async def test_a_cloned_voice_gives_the_same_tokens_from_an_uncached_and_a_cached_reference(
    engine: OrpheusEngine, name: str, sampling: dict, audio_seed: int
) -> None:
    engine.add_voice(name, audio=voice_audio(5.0, seed=audio_seed), transcript=TRANSCRIPT)
    _, log1, cached1, _ = await timed(engine, name, **sampling, **SHORT)
    _, log2, cached2, _ = await timed(engine, name, **sampling, **SHORT)
    assert cached1 == 0 and cached2 >= block_size(engine)
    assert len(log1) > 0 and log1 == log2
    print(f"\n{name} {sampling}: cached {cached1} then {cached2}, {len(log1)} ids equal")
