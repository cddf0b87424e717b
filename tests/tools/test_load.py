"""`orpheus-tts load` against real servers on loopback: the report's figures, side by side schemes, rejections."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.cli import main
from orpheus_tts_plugin.server.serve import serving_in_thread
from orpheus_tts_plugin.tools.load import LoadOptions, run

PACES = {"fast": 0.0, "paced": 400.0}  # synthetic tokens/s a stream


def load_config(config: EngineConfig, pace: str, **changes: object) -> EngineConfig:
    """Short utterances (the token budget sets their length), at the test's pacing."""
    synthetic = SyntheticConfig(tokens_per_second=PACES[pace], frames_per_prompt_token=64.0)
    return replace(config, synthetic=synthetic, token_budget_per_char=2.0, token_budget_base=0, **changes)


@pytest.mark.parametrize("pace", list(PACES))
def test_load_reports_ttfb_underruns_and_rtf_for_reused_and_fresh_connections_side_by_side(
    synthetic_config: EngineConfig, tmp_path: Path, pace: str
) -> None:
    engine = OrpheusEngine(load_config(synthetic_config, pace))
    out = tmp_path / "load.json"
    with serving_in_thread(engine) as srv:
        args = f"load {srv.url} --procs 2 --concurrency 2 --duration 1.5 --drain 20 --traffic constant,variable"
        assert (
            main(
                [
                    *shlex.split(args),
                    "--fresh-connection",
                    "--budget-per-char",
                    "2",
                    "--no-progress",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        served = engine.stats()
    result = json.loads(out.read_text())
    points = {(p["traffic"], p["scheme"]): p for p in result["points"]}
    assert set(points) == {(t, s) for t in ("constant", "variable") for s in ("reuse", "fresh")}
    constant = points["constant", "reuse"]
    assert constant["procs"] == 2 and constant["utterances"] > 0 and constant["incomplete"] == 0
    assert constant["rejected"] == 0 and constant["rtf_p50"] > 0 and constant["server_cpu_s"] > 0
    assert constant["ttfb_p50_ms"] <= constant["ttfb_p95_ms"] <= constant["ttfb_p99_ms"]
    assert {k for k in constant if "ttfb" in k} >= {"ttfb_p50_ms", "ttfb_p95_ms", "ttfb_p99_ms"}
    assert "underruns" in constant and "host_cpu_per_stream" in constant
    heard = sum(p["utterances"] + p["incomplete"] for p in result["points"])
    assert served["streams_started"] == heard + 1  # every request reached the server (the one more: the warm-up)
    assert [Path(p).name for p in result["plots"]] == ["load-constant.png", "load-variable.png"]
    assert all(Path(p).stat().st_size > 0 for p in result["plots"])


@pytest.mark.parametrize("pace", list(PACES))
def test_load_beyond_the_servers_capacity_shows_as_rejections(
    synthetic_config: EngineConfig, tmp_path: Path, pace: str
) -> None:
    engine = OrpheusEngine(load_config(synthetic_config, pace, max_streams=1))
    with serving_in_thread(engine) as srv:
        result = run(LoadOptions(url=srv.url, procs=1, concurrency=(3,), duration_s=1.0, drain_s=20, progress=False))
    (point,) = result["points"]
    assert point["rejected"] > 0 and point["utterances"] > 0
    assert point["realtime"] is False  # a rejection fails the point, as in `bench engine`


def test_load_can_start_its_own_server_and_run_the_same_load_in_process(test_model_dir: Path, tmp_path: Path) -> None:
    serve = (
        f"--backend synthetic --model '' --snac {test_model_dir / 'snac'} --device cpu --token-rate 400 "
        f"--frames-per-token 64 --budget-per-char 2 --budget-base 0 --cpus {max(os.sched_getaffinity(0))} "
        "--api-key k1 --api-key k2"
    )  # the in-process scheme's worker pins itself to the server's --cpus; the clients send its first key
    result = run(
        LoadOptions(
            serve=serve,
            in_process=True,
            concurrency=(2,),
            duration_s=1.0,
            drain_s=20,
            budget_per_char=2,
            progress=False,
        )
    )
    by_scheme = {p["scheme"]: p for p in result["points"]}
    assert set(by_scheme) == {"reuse", "in-process"}
    for point in by_scheme.values():
        assert point["utterances"] > 0 and point["incomplete"] == 0 and point["rejected"] == 0
    assert by_scheme["in-process"]["server_cpu_s"] == 0 and by_scheme["reuse"]["server_cpu_s"] > 0
    assert result["options"]["backend"] == "synthetic via orpheus-tts serve"


def test_load_options_are_checked() -> None:
    with pytest.raises(ValueError, match="URL or --serve"):
        LoadOptions()
    with pytest.raises(ValueError, match="--in-process needs"):
        LoadOptions(url="ws://127.0.0.1:1", in_process=True)
    with pytest.raises(ValueError, match="traffic"):
        LoadOptions(url="ws://127.0.0.1:1", traffic=("bursty",))
