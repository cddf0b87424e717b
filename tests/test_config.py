"""The engine's options: defaults, each bad value refused where it is built, sampling overrides."""

from __future__ import annotations

from typing import Any

import pytest

from orpheus_tts_plugin import EngineConfig, SamplingOverrides, SamplingParams, SyntheticConfig


def test_by_default_every_admitted_stream_has_a_batch_row() -> None:
    config = EngineConfig()
    assert config.batch_size == config.max_streams


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"backend": "gpu"}, ValueError, "unknown backend 'gpu'; choose one of hf, synthetic"),
        ({"decoder": "fast"}, ValueError, "unknown decoder 'fast'"),
        ({"max_streams": 0}, ValueError, "max_streams must be an int >= 1, got 0"),
        ({"max_streams": True}, TypeError, "max_streams must be an int, got bool"),
        ({"queue_timeout_s": 0.0}, ValueError, r"queue_timeout_s must be finite and > 0"),
        ({"decode_ahead_s": float("nan")}, ValueError, "decode_ahead_s"),
        ({"noise_seed": 2**63}, ValueError, r"noise_seed must be an int in \[0, "),
        ({"sentence_max_chars": 19}, ValueError, "sentence_max_chars"),
        ({"max_text_chars": 0}, ValueError, "max_text_chars must be an int >= 1, got 0"),
        ({"sampling": SamplingParams(top_p=0.0)}, ValueError, r"top_p must be in \(0, 1\]"),
    ],
    ids=str,
)
def test_a_bad_engine_option_is_refused_naming_its_field_and_range(
    options: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        EngineConfig(**options)


def test_a_bad_synthetic_option_is_refused_naming_its_field() -> None:
    with pytest.raises(ValueError, match="min_frames"):
        SyntheticConfig(min_frames=0)
    with pytest.raises(TypeError, match="endless must be a bool"):
        SyntheticConfig(endless=1)  # type: ignore[arg-type]


def test_sampling_overrides_change_only_the_fields_given_and_the_result_is_checked() -> None:
    overrides = SamplingOverrides.of(temperature=0.9, seed=7)
    assert overrides.given() == {"temperature": 0.9, "seed": 7}
    assert overrides.apply(SamplingParams()) == SamplingParams(temperature=0.9, seed=7)
    assert SamplingOverrides.of(overrides, seed=None).given() == {"temperature": 0.9}
    with pytest.raises(ValueError, match="top_p"):
        SamplingOverrides.of(top_p=1.5).apply(SamplingParams())


def test_an_unknown_sampling_override_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TypeError, match="unknown sampling option.* stop; known: temperature, top_p"):
        SamplingOverrides.of(stop=3)


def test_the_engine_text_limit_is_serves_and_serve_gives_its_engine_the_limit_it_enforces() -> None:
    from orpheus_tts_plugin.cli import build_parser
    from orpheus_tts_plugin.server.policy import Policy
    from orpheus_tts_plugin.server.serve import engine_config, policy

    args = build_parser().parse_args(["serve"])
    assert EngineConfig().max_text_chars == Policy().max_chars == args.max_chars == 4096
    args = build_parser().parse_args(["serve", "--max-chars", "10000"])
    assert engine_config(args).max_text_chars == policy(args).max_chars == 10000
