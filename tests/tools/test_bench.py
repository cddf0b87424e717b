"""`bench engine`, its player and capacity rule, the reference decode scheme and the GPU script's smoke mode.

Benchmarks report figures; these tests check behaviour and structure only, never timing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.cli import main as cli
from orpheus_tts_plugin.codec.snac import load_snac
from orpheus_tts_plugin.spec import SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.bench.engine import reference_decoder
from orpheus_tts_plugin.tools.bench.figures import Utterance, capacity, capacity_lines, play, summarize
from orpheus_tts_plugin.tools.bench.reference import ReferenceDecoder, reference_decode

SECOND = 24_000  # samples


# ------------------------------------------------------------------------------------ the player


def test_player_that_is_never_starved_counts_no_underrun() -> None:
    # 1 s of audio arrives at t=0, then 1 s more exactly when the first ends, then early.
    out = play([(10.0, SECOND), (11.0, SECOND), (11.5, SECOND)])
    assert (out.underruns, out.underrun_s, out.audio_s) == (0, 0.0, 3.0)


def test_player_waits_from_the_end_of_its_audio_to_the_next_arrival() -> None:
    # plays 0–0.5 s, starved until 0.8 s; plays 0.8–1.3 s, chunk at 1.0 extends to 1.8 s; starved until 2.0 s.
    out = play([(0.0, SECOND // 2), (0.8, SECOND // 2), (1.0, SECOND // 2), (2.0, SECOND // 4)])
    assert out.underruns == 2
    assert out.underrun_s == pytest.approx(0.3 + 0.2)
    assert out.audio_s == pytest.approx(1.75)


def test_player_counts_the_wait_of_an_abandoned_stream_and_nothing_before_the_first_byte() -> None:
    assert play([(5.0, SECOND)], abandoned_at=7.5).underrun_s == pytest.approx(1.5)
    assert play([(5.0, SECOND)], abandoned_at=5.5).underruns == 0  # still playing when abandoned
    assert play([], abandoned_at=9.0) == play([])  # never started: TTFB's business, not an underrun


def test_summary_of_a_constructed_point() -> None:
    ok = Utterance(0, requested=0.0, chunks=[(0.1, SECOND), (0.5, SECOND)], ended=0.5, complete=True)
    starved = Utterance(1, requested=0.0, chunks=[(0.3, SECOND // 2), (1.0, SECOND // 2)], ended=1.0, complete=True)
    point = summarize([ok, starved], wall_s=1.0, cpu_s=0.5, tokens=166, sla_ms=1000.0)
    assert point["utterances"] == 2 and point["incomplete"] == 0
    assert point["ttfb_p50_ms"] == pytest.approx(200.0)
    assert point["underrun_rate"] == point["failed_rate"] == 0.5 and point["underruns"] == 1
    assert point["underrun_s"] == pytest.approx(0.2)
    assert point["audio_s"] == pytest.approx(3.0)
    assert point["mean_concurrency"] == pytest.approx(1.5)
    assert point["rtf_p50"] == pytest.approx(0.5 * (0.5 / 2 + 1.0 / 1))
    assert point["realtime"] is False  # an underrun
    point = summarize([ok], wall_s=1.0, cpu_s=0.5, tokens=166, sla_ms=1000.0)
    assert point["realtime"] is True
    assert summarize([ok], wall_s=1.0, cpu_s=0.5, tokens=166, sla_ms=50.0)["realtime"] is False  # over the SLA
    assert summarize([], wall_s=1.0, cpu_s=0.0, tokens=0, sla_ms=50.0)["realtime"] is None  # no evidence


def test_an_utterance_cut_off_before_its_first_byte_fails_the_point_without_an_underrun() -> None:
    ok = Utterance(0, requested=0.0, chunks=[(0.1, SECOND)], ended=0.2, complete=True)
    cut = Utterance(1, requested=0.0, ended=3.0)  # cancelled at the end of the point, never heard
    point = summarize([ok, cut], wall_s=3.0, cpu_s=0.5, tokens=100, sla_ms=10_000.0)
    assert (point["utterances"], point["incomplete"], point["underruns"]) == (1, 1, 0)
    assert point["failed_rate"] == 0.5 and point["underrun_rate"] == 0.0
    assert point["ttfb_max_ms"] == pytest.approx(3000.0)  # its wait counts, as a lower bound
    assert point["realtime"] is False


# ------------------------------------------------------------------------------------ capacity


def _point(traffic: str, scheme: str, n: float, realtime: bool | None) -> dict:
    return {"traffic": traffic, "scheme": scheme, "concurrency": n, "rate_per_s": None, "mean_concurrency": n * 0.9,
            "realtime": realtime}  # fmt: skip


def test_capacity_is_the_largest_passing_concurrency_and_a_failure_below_it_is_reported() -> None:
    points = [
        _point("constant", "project", 8, False),
        _point("constant", "project", 1, True),
        _point("constant", "project", 4, True),
        _point("constant", "project", 16, True),  # passes above a failure: a noisy sweep
        _point("constant", "project", 32, False),
        _point("constant", "project", 64, None),  # no calls, no evidence: skipped
        _point("constant", "reference", 1, False),
        _point("variable", "project", 2, True),
    ]
    cap = capacity(points)
    assert cap["constant"]["project"]["streams"] == 16
    assert cap["constant"]["project"]["first_failure"] == 8
    assert cap["constant"]["project"]["mean_concurrency"] == pytest.approx(16 * 0.9)
    assert cap["constant"]["reference"] == {"streams": 0, "rate_per_s": None, "mean_concurrency": 0.0,
                                            "first_failure": 1}  # fmt: skip
    assert cap["variable"]["project"]["streams"] == 2 and cap["variable"]["project"]["first_failure"] is None


# ------------------------------------------------------------------------------------ the reference scheme


def _frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7))


def test_the_capacity_summary_labels_each_figure() -> None:
    points = [_point("constant", "reuse", 1, False), _point("constant", "reuse", 2, True)]
    lines = capacity_lines({"options": {"ttfb_sla_ms": 250.0}, "capacity": capacity(points)})
    assert lines[0].startswith("real-time capacity: the most concurrent streams whose point passed (")
    assert "p95 TTFB <= 250 ms" in lines[0]
    assert lines[1] == (
        "  constant traffic, reuse (one connection per client process, reused): 2 streams; "
        "first failing point: 1 streams (below the capacity: a noisy sweep)"
    )


def test_reference_decoder_emits_what_the_reference_emits(test_model_dir: Path) -> None:
    snac = load_snac(str(test_model_dir / "snac"))
    decoder = ReferenceDecoder(snac)
    state, frames, chunks = decoder.new_state(), _frames(9), []
    for k, frame in enumerate(frames):
        state.pending.append(frame[None])
        assert state.ready(decoder.first_chunk_frames) == (k >= 3)
        if state.ready(decoder.first_chunk_frames):
            chunks.append(decoder.decode([state])[0])
    state.final = True
    assert decoder.decode([state])[0].size == 0  # the last two frames are never emitted
    expected = [reference_decode(snac, frames[None, k - 3 : k + 1])[0] for k in range(3, 9)]
    assert [c.size for c in chunks] == [SAMPLES_PER_FRAME] * 6
    assert all(np.array_equal(c, e) for c, e in zip(chunks, expected))
    assert decoder.stats()["decoded_frames"] == 4 * 6 and decoder.calls == 6


async def test_engine_runs_the_reference_scheme(test_model_dir: Path) -> None:
    frames = 10
    lengths = {}
    for decoder in ("snac", "reference"):
        config = EngineConfig(
            model=None,
            backend="synthetic",
            snac=str(test_model_dir / "snac"),
            device="cpu",
            synthetic=SyntheticConfig(min_frames=frames, frames_per_prompt_token=0.0),
        )
        # The reference scheme is a benchmark baseline: the bench injects it, the runtime never names it.
        engine = OrpheusEngine(config, decoder=reference_decoder(config) if decoder == "reference" else None)
        try:
            lengths[decoder] = sum([c.num_samples async for c in engine.synthesize("Hello there.")])
        finally:
            await engine.aclose()
    assert lengths == {"snac": frames * SAMPLES_PER_FRAME, "reference": (frames - 3) * SAMPLES_PER_FRAME}


# ------------------------------------------------------------------------------------ the command


def test_bench_engine_synthetic_sweep_writes_figures_and_plots(tmp_path: Path, test_model_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench" / "engine.json"
    args = ["bench", "engine", "--backend", "synthetic", "--snac", str(test_model_dir / "snac")]
    args += ["--traffic", "constant,variable", "--streams", "1,3", "--duration", "1.5", "--drain", "20"]
    args += ["--decode-scheme", "reference", "--token-rate", "400", "--budget-per-char", "1"]
    assert cli([*args, "--ttfb-sla-ms", "5000", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    points = result["points"]
    assert {(p["traffic"], p["scheme"], p["concurrency"]) for p in points} == {
        (t, s, n) for t in ("constant", "variable") for s in ("project", "reference") for n in (1.0, 3.0)
    }
    for p in points:
        for key in ("ttfb_p50_ms", "ttfb_p95_ms", "ttfb_p99_ms", "underrun_rate", "failed_rate", "rtf_p50"):
            assert key in p
        assert p["host_cpu_cores"] > 0 and p["tokens_per_s"] >= 0 and p["incomplete"] == 0
    for p in (p for p in points if p["traffic"] == "constant"):
        assert p["utterances"] >= p["concurrency"] and p["ttfb_p50_ms"] > 0 and p["tokens"] > 0
        work = p["decoded_frames_per_audio_frame"]  # every emitted frame costs a 4-frame window, ours once
        assert work == pytest.approx(4.0) if p["scheme"] == "reference" else 1.0 < work <= 2.0
    variable = [p for p in points if p["traffic"] == "variable"]
    assert all(p["rate_per_s"] > 0 for p in variable)
    assert set(result["capacity"]) == {"constant", "variable"}
    assert set(result["capacity"]["constant"]) == {"project", "reference"}
    assert {"date", "machine", "command", "commit"} <= set(result["meta"])
    for traffic in ("constant", "variable"):
        png = out.with_name(f"engine-{traffic}.png")
        assert str(png) in result["plots"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_engine_rejects_unknown_schemes() -> None:
    from orpheus_tts_plugin.tools.bench.engine import BenchOptions

    with pytest.raises(ValueError, match="decode schemes"):
        BenchOptions(schemes=("fast",))
    with pytest.raises(ValueError, match="traffic"):
        BenchOptions(traffic=("bursty",))


# ------------------------------------------------------------------------------------ the GPU script


def test_gpu_script_smoke_mode(tmp_path: Path, test_model_dir: Path, run_script: Callable[..., Any]) -> None:
    out = tmp_path / "gpu.json"
    args = ("--smoke", "--assets", str(test_model_dir), "--out", str(out))
    run = run_script("gpu_bench.py", *args, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and not result["errors"]
    rows = result["decoder"]["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    # Eager only: compiling on CPU takes minutes; tests/test_decoder.py checks the compiled step decodes as eager.
    assert result["decoder"]["modes"] == ["eager"]
    assert all(r["eager_x_rt"] > 0 and r["reference_eager_x_rt"] > 0 for r in rows)
    check, *timed = result["backend"]["rows"]
    assert check["same_leading_tokens"] == check["of"] == 60  # the static step (what CUDA captures) vs eager
    backend = [r for r in timed if "concurrency" in r]
    assert [(r["variant"], r["concurrency"]) for r in backend] == [
        ("graphs", 1),
        ("graphs", 2),
        ("eager", 1),
        ("eager", 2),
    ]
    assert all(r["completed"] == r["concurrency"] for r in backend)
    assert all(r["tokens28_p50_ms"] > 0 for r in backend)
    assert [p["concurrency"] for p in result["engine"]["points"]] == [1.0, 2.0]
    assert "constant" in result["engine"]["capacity"]


def test_bench_lora_times_no_adapter_and_two_adapters_all_base_and_half_used(tmp_path: Path, test_model_dir: Path):
    out = tmp_path / "lora.json"
    model = str(test_model_dir / "orpheus")
    assert cli(["bench", "lora", "--model", model, "--batch", "1,2", "--steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "lora" and sorted(result["adapters"]) == ["a", "b"] and result["rank"] == 16
    for point in result["batch"].values():
        assert set(point) == {"none", "lora-base", "lora-half"}
        assert all(p["tokens_per_s"] > 0 and len(p["rounds_tokens_per_s"]) == 3 for p in point.values())
