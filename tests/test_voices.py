"""Cloned voices through the engine's public API: the reference turn in every prompt (Canopy's zero-shot layout),
input refused in one line, the voice list, and the same tokens with the hf prefix store on and off."""

from __future__ import annotations

import wave
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.spec import CODEBOOK_SIZE, ENGLISH, SAMPLE_RATE
from tests.stubs import SPEED_IDS, SPEEDS, started

SPEC = ENGLISH
TRANSCRIPT = "This is how I sound when I read aloud."


class RecordingBackend(SyntheticBackend):
    """Synthetic tokens; keeps every request it was given."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.requests: list = []

    def generate(self, req):  # type: ignore[no-untyped-def]
        self.requests.append(req)
        return super().generate(req)


def voice_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """A reference recording: a few tones and noise, float32 at 24 kHz."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    tones = sum(np.sin(2 * np.pi * f * t) for f in (180 + 40 * seed, 420, 910))
    return (0.1 * tones + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def write_wav(path: Path, pcm: np.ndarray, rate: int = SAMPLE_RATE, channels: int = 1) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return path


def canopy_audio_ids(snac: Any, audio: np.ndarray) -> list[int]:
    """The reference's ids as Canopy's pretrained-inference notebook writes them (`tokenise_audio`)."""
    with torch.inference_mode():
        codes = snac.encode(torch.from_numpy(audio)[None, None])
    out = []
    for i in range(codes[0].shape[1]):
        out.append(codes[0][0][i].item() + 128266)
        out.append(codes[1][0][2 * i].item() + 128266 + 4096)
        out.append(codes[2][0][4 * i].item() + 128266 + (2 * 4096))
        out.append(codes[2][0][(4 * i) + 1].item() + 128266 + (3 * 4096))
        out.append(codes[1][0][(2 * i) + 1].item() + 128266 + (4 * 4096))
        out.append(codes[2][0][(4 * i) + 2].item() + 128266 + (5 * 4096))
        out.append(codes[2][0][(4 * i) + 3].item() + 128266 + (6 * 4096))
    return out


def recording_engine(config: EngineConfig) -> tuple[OrpheusEngine, RecordingBackend]:
    backend = RecordingBackend(config.synthetic)
    return OrpheusEngine(config, backend=backend), backend


@pytest.fixture(params=list(SPEEDS.values()), ids=SPEED_IDS)
def speed(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> EngineConfig:
    return replace(synthetic_config, synthetic=replace(synthetic_config.synthetic, tokens_per_second=request.param))


async def test_the_prompt_holds_the_references_codes_in_order_once_before_each_sentence(
    speed: EngineConfig, tiny_snac: Any
) -> None:
    audio = voice_audio(2.0)
    text = "Hello there, this is the first sentence of two. And here is the second one, a little longer."
    before, backend = recording_engine(replace(speed, sentence_max_chars=40))
    before.add_voice("ana", audio=audio, transcript=TRANSCRIPT)  # before start: encoded when the engine starts
    after, backend2 = recording_engine(replace(speed, sentence_max_chars=40))
    await after.start()
    after.add_voice("ana", audio=audio, transcript=TRANSCRIPT)  # after start: encoded at once
    try:
        sentences = before.sentences(text)
        assert len(sentences) >= 2
        for engine in (before, after):
            chunks = [c async for c in engine.synthesize(text, voice="ana", seed=3)]
            assert chunks[-1].final and {c.utterance for c in chunks} == set(range(len(sentences)))
        tok = before._tokenizer
    finally:
        await before.aclose()
        await after.aclose()

    codes = canopy_audio_ids(tiny_snac, audio)
    assert len(codes) == 7 * 24  # 2 s: 23.4 frames, padded to 24
    turn = (SPEC.start_of_human, *tok(TRANSCRIPT)["input_ids"], *SPEC.prompt_suffix())
    reference = (*turn, *codes, SPEC.end_of_speech, SPEC.end_of_ai)
    assert [r.prompt_ids for r in backend.requests] == [r.prompt_ids for r in backend2.requests]
    for req, sentence in zip(backend.requests, sentences, strict=True):
        said = (SPEC.start_of_human, *tok(sentence)["input_ids"], *SPEC.prompt_suffix())
        assert req.prompt_ids == (*reference, *said)
        assert req.prefix_len == len(reference)
        audio_ids = [i for i in req.prompt_ids if i >= SPEC.first_audio_token]
        assert audio_ids == codes  # the reference's codes, in order, once
        assert req.prompt_ids.count(SPEC.end_of_ai) == 1


async def test_stock_voices_keep_their_prompt_and_cloned_voices_are_listed_after_them(
    synthetic_config: EngineConfig,
) -> None:
    engine, backend = recording_engine(synthetic_config)
    engine.add_voice("ana", audio=(voice_audio(1.0) * 32767).astype(np.int16), transcript=TRANSCRIPT)
    assert engine.check_options(voice="ana").voice == "ana"
    assert engine.spec.voices == (*SPEC.voices, "ana") and engine.spec.default_voice == SPEC.default_voice
    listed = engine.voices()
    assert [v["name"] for v in listed] == [*SPEC.voices, "ana"]
    assert listed[-1] == {"name": "ana", "kind": "cloned", "seconds": 1.0, "transcript": TRANSCRIPT, "prompt_ids": None}
    await engine.start()
    try:
        encoded = engine.voices()[-1]["prompt_ids"]
        assert encoded > 7 * 12  # 1 s: 12 frames
        [_ async for _ in engine.synthesize("Hi.", voice="leo")]
        [req] = backend.requests
        assert req.prefix_len == 0 and SPEC.end_of_ai not in req.prompt_ids
        assert req.prompt_ids[:2] == (SPEC.start_of_human, SPEC.bos)
        engine.remove_voice("ana")
        assert engine.spec.voices == SPEC.voices
        with pytest.raises(ValueError, match="unknown voice 'ana'"):
            engine.check_options(voice="ana")
        with pytest.raises(KeyError, match="no added voice 'ana'"):
            engine.remove_voice("ana")
    finally:
        await engine.aclose()


def _bad_inputs(tmp: Path) -> list[tuple[dict[str, Any], type[Exception], str]]:
    ok = voice_audio(1.0)
    return [
        ({"name": ""}, ValueError, "must be 1-64 letters"),
        ({"name": "two words"}, ValueError, "must be 1-64 letters"),
        ({"name": 7}, TypeError, "voice name must be a str"),
        ({"name": "tara"}, ValueError, "is a stock voice"),
        ({"name": "ana"}, ValueError, "already added"),
        ({"transcript": "  "}, ValueError, "transcript is empty"),
        ({"transcript": None}, TypeError, "transcript must be a str"),
        ({"audio": ok[:2000]}, ValueError, "shorter than one frame"),
        ({"audio": voice_audio(31.0)}, ValueError, "over 30 s"),
        ({"audio": np.stack([ok, ok])}, ValueError, "must be 1-D"),
        ({"audio": ok.astype(np.int32)}, TypeError, "must be float or int16"),
        ({"audio": np.full(4096, np.nan, np.float32)}, ValueError, "NaN"),
        ({"audio": [0.0] * 4096}, TypeError, "a WAV path or a numpy array"),
        ({"audio": str(write_wav(tmp / "16k.wav", np.zeros(16000), rate=16000))}, ValueError, "resample"),
        ({"audio": str(tmp / "missing.wav")}, ValueError, "not a readable WAV"),
    ]


def test_bad_voices_are_refused_in_one_line(synthetic_config: EngineConfig, tmp_path: Path) -> None:
    engine = OrpheusEngine(synthetic_config)
    engine.add_voice("ana", audio=voice_audio(1.0), transcript=TRANSCRIPT)
    for change, kind, match in _bad_inputs(tmp_path):
        args = {"name": "bob", "audio": voice_audio(1.0), "transcript": TRANSCRIPT, **change}
        with pytest.raises(kind, match=match) as info:
            engine.add_voice(args.pop("name"), **args)
        assert "\n" not in str(info.value), change
    short = OrpheusEngine(replace(synthetic_config, max_seq_len=1024))
    with pytest.raises(ValueError, match="too many for max_seq_len 1024"):
        short.add_voice("bob", audio=voice_audio(10.0), transcript=TRANSCRIPT)
    assert [v["name"] for v in engine.voices()] == [*SPEC.voices, "ana"]  # nothing refused was added


async def test_a_wav_reference_equals_its_samples_and_stereo_is_mixed_down(
    synthetic_config: EngineConfig, tmp_path: Path
) -> None:
    pcm = (voice_audio(1.0) * 32767).astype(np.int16)
    stereo = np.stack([pcm, pcm], axis=1).ravel()
    engine, backend = recording_engine(synthetic_config)
    engine.add_voice("from-array", audio=pcm, transcript=TRANSCRIPT)
    engine.add_voice("from-wav", audio=write_wav(tmp_path / "a.wav", pcm), transcript=TRANSCRIPT)
    engine.add_voice("from-stereo", audio=str(write_wav(tmp_path / "s.wav", stereo, channels=2)), transcript=TRANSCRIPT)
    await engine.start()
    try:
        for name in ("from-array", "from-wav", "from-stereo"):
            [_ async for _ in engine.synthesize("Hi.", voice=name, seed=1)]
    finally:
        await engine.aclose()
    prompts = {r.prompt_ids for r in backend.requests}
    assert len(prompts) == 1


@pytest.fixture(scope="module")
def hf_engines(hf_config: EngineConfig):
    """Two engines on the test model: the hf prefix store on (the default) and off."""
    import asyncio

    engines = [OrpheusEngine(replace(hf_config, backend_options=(("prefix_reuse", reuse),))) for reuse in (True, False)]
    for engine in engines:
        engine.add_voice("ana", audio=voice_audio(3.0), transcript=TRANSCRIPT)
        asyncio.run(engine.start())
    yield engines
    for engine in engines:
        asyncio.run(engine.aclose())


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.7, "seed": 5}], ids=["greedy", "seeded"])
async def test_a_cloned_voice_speaks_the_same_tokens_with_the_prefix_store_on_and_off(
    hf_engines: list[OrpheusEngine], sampling: dict[str, Any]
) -> None:
    import asyncio

    async def tokens(engine: OrpheusEngine, voice: str, text: str) -> list[int]:
        log: list[int] = []
        async for _ in engine.synthesize(text, voice=voice, token_log=log, max_tokens=49, **sampling):
            pass
        return log

    texts = ("Hi there.", "Good morning to you.")
    runs = []
    for engine in hf_engines:
        alone = [await tokens(engine, "ana", t) for t in texts]
        mixed = await asyncio.gather(
            tokens(engine, "ana", texts[0]), tokens(engine, "tara", texts[1]), tokens(engine, "ana", texts[1])
        )
        runs.append((alone, mixed))
    on, off = runs
    assert on == off
    assert on[1][0] == on[0][0] and on[1][2] == on[0][1]  # in a batch with a stock row: the same as alone
    assert all(len(t) > 7 for t in on[0])
    stats = [e.stats()["backend"] for e in hf_engines]
    assert stats[0]["prefix_misses"] == 1 and stats[0]["prefix_hits"] >= 3 and stats[0]["cached_prefixes"] == 1
    assert "prefix_hits" not in stats[1]


async def test_removing_a_voice_frees_its_cached_prefix(hf_config: EngineConfig) -> None:
    async with started(hf_config) as engine:
        engine.add_voice("bob", audio=voice_audio(1.0, seed=2), transcript=TRANSCRIPT)
        [_ async for _ in engine.synthesize("Hi.", voice="bob", max_tokens=14)]
        assert engine.stats()["backend"]["cached_prefixes"] == 1
        engine.remove_voice("bob")
        assert engine.stats()["backend"]["cached_prefixes"] == 0


def test_reference_codes_are_within_the_codebook(tiny_snac: Any) -> None:
    from orpheus_tts_plugin.speech.voices import encode_frames

    frames = encode_frames(tiny_snac, voice_audio(1.0))
    assert frames.shape == (12, 7) and frames.min() >= 0 and frames.max() < CODEBOOK_SIZE
