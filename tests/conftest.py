"""Shared fixtures: the random-weight test checkpoints, built once per test session."""

from __future__ import annotations

from pathlib import Path

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
