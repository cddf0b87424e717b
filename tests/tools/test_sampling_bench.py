"""`orpheus-tts bench backend` smoke run: both samplers and transformers generate, one JSON with run metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orpheus_tts_plugin.cli import build_parser
from orpheus_tts_plugin.tools.bench import backend as bench_backend
from orpheus_tts_plugin.tools.testmodel import make_test_model


@pytest.fixture(scope="module")
def orpheus_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("testmodel")
    make_test_model(out, snac="tiny", seed=0)
    return str(out / "orpheus")


def test_bench_backend_reports_both_samplers_and_generate(
    orpheus_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "backend.json"
    argv = ["bench", "backend", "--model", orpheus_dir, "--batch", "1,3", "--steps", "2", "--json", str(out)]
    args = build_parser().parse_args(argv)
    assert bench_backend.main(args) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "backend" and {"date", "machine", "commit"} <= set(result["meta"])
    assert set(result["batch"]) == {"1", "3"}
    for point in result["batch"].values():
        for name in ("reference", "fast", "transformers_generate"):
            assert point[name]["tokens_per_s"] > 0
        assert len(point["fast"]["rounds_tokens_per_s"]) == bench_backend.ROUNDS
        assert point["fast_over_reference"] > 0
    assert "fast tok/s" in capsys.readouterr().out
