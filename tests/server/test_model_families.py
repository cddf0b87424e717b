"""A non-English model family spoken through the engine, a server in a thread and `orpheus-tts serve` with a
RemoteEngine: its voices reach the client, its sentences are split as its script wants."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, RemoteEngine
from orpheus_tts_plugin.server.serve import serving_in_thread
from orpheus_tts_plugin.speech.text import split_sentences
from orpheus_tts_plugin.tools.loopback import free_port
from tests.servers import serve_args, serve_process
from tests.test_text import SPLITS


# ---------------------------------------------------------------------------------------------- engine, server
def family(config: EngineConfig, name: str) -> EngineConfig:
    return replace(config, model_family=name)


async def test_an_engine_of_a_chinese_family_speaks_its_voices_and_splits_chinese(
    synthetic_config: EngineConfig,
) -> None:
    engine = OrpheusEngine(family(synthetic_config, "orpheus-zh"))
    try:
        text = SPLITS["zh"][0]
        stream = engine.synthesize(text, voice="白芷", max_tokens=70)
        chunks = [c async for c in stream]
        assert list(stream.sentences) == split_sentences(text, engine.config.sentence_max_chars) == [text]
        assert chunks and engine.check_options(None)[0] == "长乐"
        with pytest.raises(ValueError, match="valid voices: 长乐, 白芷"):
            engine.synthesize(text, voice="tara")
    finally:
        await engine.aclose()


async def test_a_server_of_a_korean_family_says_its_voices_and_a_remote_engine_checks_them(
    synthetic_config: EngineConfig,
) -> None:
    engine = OrpheusEngine(family(synthetic_config, "orpheus-ko"))
    with serving_in_thread(engine) as srv:
        deadline = time.monotonic() + 120
        while not engine.ready:
            assert time.monotonic() < deadline, engine.health()
            await asyncio.sleep(0.01)
        remote = RemoteEngine(srv.url, model_family="orpheus-ko")
        await remote.start()
        try:
            assert remote.spec.voices == ("유나", "준서") and remote.spec.languages == ("ko",)
            text = SPLITS["ko"][0]
            stream = remote.synthesize(text, voice="준서", max_tokens=70)
            assert [c async for c in stream] and list(stream.sentences) == [text]
            with pytest.raises(ValueError, match="valid voices: 유나, 준서"):
                remote.synthesize(text, voice="tara")
        finally:
            await remote.aclose()


async def test_orpheus_tts_serve_with_a_model_family_serves_its_voices(test_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = serve_args(test_model_dir / "snac", port, 0.0, "--model-family", "orpheus-hi")
    with serve_process(args, tmp_path / "serve.log"):
        remote = RemoteEngine(f"ws://127.0.0.1:{port}", model_family="orpheus-hi")
        await remote.start()
        try:
            assert remote.spec.voices == ("ऋतिका",) and remote.check_options(None)[0] == "ऋतिका"
            text = SPLITS["hi"][0]
            stream = remote.synthesize(text, max_tokens=70)
            assert [c async for c in stream] and list(stream.sentences) == [text]
            with pytest.raises(ValueError, match="valid voices: ऋतिका"):
                remote.synthesize(text, voice="leo")
        finally:
            await remote.aclose()
