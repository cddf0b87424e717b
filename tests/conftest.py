"""Shared fixtures: the random-weight test checkpoints, built once per test session, and a runner of scripts/."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orpheus_tts_plugin import EngineConfig, SyntheticConfig


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-test-model` output with the tiny SNAC: DIR/orpheus (Llama + tokenizer) and DIR/snac."""
    from orpheus_tts_plugin.tools.testmodel import make_test_model

    out = tmp_path_factory.mktemp("test-model")
    make_test_model(out, snac="tiny")
    return out


@pytest.fixture(scope="session")
def full_snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random SNAC checkpoint of the real 24 kHz architecture (no Llama)."""
    from orpheus_tts_plugin.tools.testmodel import write_snac

    out = tmp_path_factory.mktemp("snac-full") / "snac"
    write_snac(out, "full")
    return out


@pytest.fixture(scope="session")
def full_snac(full_snac_dir: Path) -> Any:
    """The full 24 kHz SNAC (random weights), loaded once: read by every test, changed by none."""
    from orpheus_tts_plugin.codec.snac import load_snac

    return load_snac(str(full_snac_dir))


@pytest.fixture(scope="session")
def tiny_snac(test_model_dir: Path) -> Any:
    """The test model's tiny SNAC, loaded once: read by every test, changed by none."""
    from orpheus_tts_plugin.codec.snac import load_snac

    return load_snac(str(test_model_dir / "snac"))


@pytest.fixture(scope="session")
def synthetic_config(test_model_dir: Path) -> EngineConfig:
    """A fast engine: synthetic tokens (no LLM), the real streaming decoder on the tiny SNAC."""
    return EngineConfig(
        model=None,
        backend="synthetic",
        snac=str(test_model_dir / "snac"),
        device="cpu",
        synthetic=SyntheticConfig(tokens_per_second=0.0),
    )


@pytest.fixture(scope="session")
def hf_config(test_model_dir: Path) -> EngineConfig:
    """The full stack on the test model: tiny Orpheus-shaped Llama (hf backend) + tiny SNAC."""
    return EngineConfig(
        model=str(test_model_dir / "orpheus"),
        backend="hf",
        snac=str(test_model_dir / "snac"),
        device="cpu",
        max_batch_size=16,
        max_seq_len=2048,
    )


@pytest.fixture(scope="session")
def lora_adapter_dir(test_model_dir: Path) -> Path:
    """A random LoRA adapter (PEFT format) of the test model: `make-test-model --adapter` output."""
    from orpheus_tts_plugin.tools.testmodel import write_lora_adapter

    out = test_model_dir / "adapter-x"
    write_lora_adapter(test_model_dir / "orpheus", out, seed=1)
    return out


@pytest.fixture(scope="session")
def hf_lora_config(hf_config: EngineConfig, lora_adapter_dir: Path) -> EngineConfig:
    """`hf_config` with adapter "x" and the fine-tuned voice "maya" it speaks."""
    from dataclasses import replace

    return replace(hf_config, adapters={"x": str(lora_adapter_dir)}, adapter_voices={"maya": "x"})


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python scripts/NAME ARGS` on this checkout's package (PYTHONPATH), not whichever one the venv installed."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}

    def run(name: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(root / "scripts" / name), *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)

    return run
