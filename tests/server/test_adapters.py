"""A server with a LoRA adapter (hf on the test model): its hello lists the adapter and the fine-tuned voice, a
RemoteEngine and the HTTP endpoint speak with it as the served engine does in-process, unknown names are refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, RemoteEngine
from orpheus_tts_plugin.cli import build_parser
from orpheus_tts_plugin.server.serve import ServerThread, engine_config
from tests.served import assert_same_audio, engine_of, http, pcm_of, serving

TEXT = "Hello there."
SAMPLING = {"seed": 3, "max_tokens": 49}


@pytest.fixture(scope="module")
def lora_served(hf_lora_config: EngineConfig) -> Iterator[ServerThread]:
    with serving(replace(hf_lora_config, max_seq_len=512)) as srv:
        yield srv


async def test_a_remote_engine_speaks_the_servers_adapter_and_fine_tuned_voice(lora_served: ServerThread) -> None:
    remote = RemoteEngine(lora_served.url)
    await remote.start()
    try:
        assert remote.adapters == ("x",) and "maya" in remote.spec.voices
        with pytest.raises(ValueError, match="unknown adapter 'nope'; this engine's adapters: x"):
            remote.check_options(adapter="nope")
        assert remote.check_options("tara", adapter="x").adapter == "x"
        got = await asyncio.gather(
            pcm_of(remote, TEXT, voice="tara", adapter="x", **SAMPLING),
            pcm_of(remote, TEXT, voice="tara", **SAMPLING),
            pcm_of(remote, TEXT, voice="maya", **SAMPLING),  # the server maps the voice to its adapter
        )
    finally:
        await remote.aclose()
    local = engine_of(lora_served)
    assert_same_audio(got[0], await pcm_of(local, TEXT, voice="tara", adapter="x", **SAMPLING))
    assert_same_audio(got[1], await pcm_of(local, TEXT, voice="tara", **SAMPLING))
    assert_same_audio(got[2], await pcm_of(local, TEXT, voice="maya", adapter="x", **SAMPLING))
    assert got[0].size != got[1].size or not np.array_equal(got[0], got[1])  # the adapter changes the audio


def test_the_http_endpoint_takes_an_adapter_field(lora_served: ServerThread) -> None:
    body = {"model": "orpheus", "input": TEXT, "voice": "tara", "response_format": "pcm", **SAMPLING}
    status, with_adapter = http(lora_served, "/v1/audio/speech", {**body, "adapter": "x"})
    assert status == 200
    reference = asyncio.run(pcm_of(engine_of(lora_served), TEXT, voice="tara", adapter="x", **SAMPLING))
    assert_same_audio(np.frombuffer(with_adapter, dtype="<i2"), reference)
    status, error = http(lora_served, "/v1/audio/speech", {**body, "adapter": "nope"})
    assert status == 400 and "unknown adapter 'nope'" in json.loads(error)["error"]["message"]
    status, error = http(lora_served, "/v1/audio/speech", {**body, "adapter": 3})
    assert status == 400 and "adapter must be a string" in json.loads(error)["error"]["message"]


def test_serve_flags_name_adapters_and_fine_tuned_voices(lora_adapter_dir: Path) -> None:
    args = [
        "serve",
        "--backend",
        "hf",
        "--model",
        "m",
        "--adapter",
        f"x={lora_adapter_dir}",
        "--adapter-voice",
        "maya=x",
    ]
    config = engine_config(build_parser().parse_args(args))
    assert config.adapters == (("x", str(lora_adapter_dir)),) and config.adapter_voices == (("maya", "x"),)
    with pytest.raises(ValueError, match="--adapter takes KEY=VALUE, got 'x'"):
        engine_config(build_parser().parse_args(["serve", "--adapter", "x"]))
