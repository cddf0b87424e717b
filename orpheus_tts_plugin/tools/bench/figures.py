"""Figures of `orpheus-tts bench engine` from what each caller saw: the player, percentiles, capacity, plots.

Pure functions of recorded chunk arrival times, so that they can be checked on constructed timelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...spec import SAMPLE_RATE
from .common import print_rows, write_json

# ------------------------------------------------------------------------------------------ player


@dataclass(frozen=True)
class Playback:
    """What a listener got: audio seconds played, times the player waited for audio, and for how long."""

    audio_s: float
    underruns: int
    underrun_s: float


def play(chunks: Sequence[tuple[float, int]], abandoned_at: float | None = None, rate: int = SAMPLE_RATE) -> Playback:
    """Simulate a player that starts at the first chunk's arrival and plays `rate` samples a second.

    `chunks` are (arrival time s, samples). A chunk that arrives after the audio before it has
    finished playing is an underrun: the player waited from then until the arrival. A stream
    abandoned at `abandoned_at` before its end also counts the wait it was in at that time.
    """
    played_until: float | None = None
    underruns, waited, samples = 0, 0.0, 0
    for arrival, n in chunks:
        if played_until is None:
            played_until = arrival
        elif arrival > played_until:
            underruns, waited, played_until = underruns + 1, waited + arrival - played_until, arrival
        played_until += n / rate
        samples += n
    if abandoned_at is not None and played_until is not None and abandoned_at > played_until:
        underruns, waited = underruns + 1, waited + abandoned_at - played_until
    return Playback(samples / rate, underruns, waited)


@dataclass
class Utterance:
    """One synthesize() call as its caller saw it."""

    text: int  # index into UTTERANCES
    requested: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    ended: float | None = None
    complete: bool = False
    rejected: bool = False

    @property
    def ttfb_s(self) -> float | None:
        """Request → first audio byte; if none came, the time waited (a lower bound)."""
        if self.chunks:
            return self.chunks[0][0] - self.requested
        return None if self.ended is None or self.rejected else self.ended - self.requested


# ------------------------------------------------------------------------------------------ figures


def _percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"ttfb_p50_ms": None, "ttfb_p95_ms": None, "ttfb_p99_ms": None, "ttfb_max_ms": None}
    p50, p95, p99 = np.percentile(values, [50, 95, 99]) * 1e3
    return {"ttfb_p50_ms": p50, "ttfb_p95_ms": p95, "ttfb_p99_ms": p99, "ttfb_max_ms": max(values) * 1e3}


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def summarize(records: list[Utterance], wall_s: float, cpu_s: float, tokens: int, sla_ms: float) -> dict[str, Any]:
    """The figures of one sweep point; `realtime` is whether it meets the capacity criteria."""
    heard = [r for r in records if not r.rejected]
    plays = [play(r.chunks, None if r.complete else r.ended) for r in heard]
    done = [r for r in records if r.complete]
    audio_s = sum(p.audio_s for p in plays)
    busy_s = sum(r.ended - r.requested for r in heard if r.ended is not None)
    rtf = [(r.ended - r.requested) / (sum(n for _, n in r.chunks) / SAMPLE_RATE) for r in done if r.chunks]
    concurrency = busy_s / wall_s if wall_s > 0 else 0.0
    cores = cpu_s / wall_s if wall_s > 0 else 0.0
    out: dict[str, Any] = {
        "utterances": len(done),
        "incomplete": len(heard) - len(done),
        "rejected": sum(r.rejected for r in records),
        **_percentiles_ms([t for r in records if (t := r.ttfb_s) is not None]),
        "underrun_rate": _share([p.underruns > 0 for p in plays]),
        "failed_rate": _share([p.underruns > 0 or not r.complete for p, r in zip(plays, heard)]),  # what plots show
        "underruns": sum(p.underruns for p in plays),
        "underrun_s": sum(p.underrun_s for p in plays),
        "stall_ratio": sum(p.underrun_s for p in plays) / audio_s if audio_s else 0.0,
        "rtf_p50": float(np.median(rtf)) if rtf else None,
        "rtf_p95": float(np.percentile(rtf, 95)) if rtf else None,
        "audio_s": audio_s,
        "mean_concurrency": concurrency,
        "wall_s": wall_s,
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "host_cpu_cores": cores,
        "host_cpu_per_stream": cores / concurrency if concurrency else None,
        "host_cpu_s_per_audio_s": cpu_s / audio_s if audio_s else None,
    }
    passed = bool(
        out["utterances"]
        and out["underruns"] == 0
        and out["incomplete"] == 0
        and out["rejected"] == 0
        and out["ttfb_p95_ms"] <= sla_ms
    )
    out["realtime"] = passed if records else None  # None: no call arrived, no evidence either way
    return out


def capacity(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Real-time capacity per traffic and scheme: the largest swept concurrency whose point passed.

    `first_failure` is the smallest concurrency that failed: below `streams` it marks a noisy sweep
    (a pass above a failure), which the docs report rather than hide. Points with no calls are skipped.
    """
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({(p["traffic"], p["scheme"]) for p in points}):
        rows = sorted((p for p in points if (p["traffic"], p["scheme"]) == key), key=lambda p: p["concurrency"])
        passed = [p for p in rows if p["realtime"]]
        failed = [p["concurrency"] for p in rows if p["realtime"] is False]
        best = passed[-1] if passed else {"concurrency": 0, "rate_per_s": None, "mean_concurrency": 0.0}
        out.setdefault(key[0], {})[key[1]] = {
            "streams": best["concurrency"],
            "rate_per_s": best["rate_per_s"],
            "mean_concurrency": best["mean_concurrency"],
            "first_failure": failed[0] if failed else None,
        }
    return out


# ------------------------------------------------------------------------------------------ report

COLUMNS = {
    "traffic": "traffic",
    "scheme": "scheme",
    "concurrency": "N",
    "rate_per_s": "arrivals/s",
    "mean_concurrency": "mean N",
    "utterances": "done",
    "incomplete": "unfinished",
    "ttfb_p50_ms": "ttfb p50",
    "ttfb_p95_ms": "p95",
    "ttfb_p99_ms": "p99 ms",
    "underrun_rate": "underrun",
    "stall_ratio": "stall",
    "rtf_p50": "rtf p50",
    "host_cpu_per_stream": "cpu/stream",
    "tokens_per_s": "tok/s",
    "realtime": "ok",
}


def write_plots(result: dict[str, Any], json_path: str) -> list[str]:
    """One PNG per traffic pattern beside `json_path`: TTFB percentiles and failed utterances against concurrency.

    Failed: an underrun, or not finished by the end of the point (which may never have started to play).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    paths = []
    sla = result["options"]["ttfb_sla_ms"]
    for traffic in dict.fromkeys(p["traffic"] for p in result["points"]):
        points = [p for p in result["points"] if p["traffic"] == traffic]
        if not points:
            continue
        span = max(p["concurrency"] for p in points) / min(p["concurrency"] for p in points)
        fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
        for i, scheme in enumerate(dict.fromkeys(p["scheme"] for p in points)):
            rows = sorted((p for p in points if p["scheme"] == scheme), key=lambda p: p["concurrency"])
            x = [p["concurrency"] for p in rows]
            color = f"C{i}"
            for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                y = [np.nan if p[f"ttfb_{q}_ms"] is None else p[f"ttfb_{q}_ms"] for p in rows]
                ax_t.plot(x, y, style, color=color, marker="o", ms=3, label=f"{scheme} {q}")
            ax_u.plot(x, [100 * p["failed_rate"] for p in rows], "-o", color=color, ms=3, label=scheme)
            cap = result["capacity"][traffic][scheme]["streams"]
            if cap:
                ax_u.axvline(cap, color=color, lw=0.8, alpha=0.6)
        ax_t.axhline(sla, color="grey", lw=0.8, label=f"SLA p95 {sla:g} ms")
        ax_t.set(xlabel="concurrent streams", ylabel="time to first byte (ms)", yscale="log")
        ax_u.set(xlabel="concurrent streams", ylabel="underrun or unfinished (%)", ylim=(-3, 103))
        levels = sorted({p["concurrency"] for p in points})
        for ax in (ax_t, ax_u):
            if span >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{v:g}" for v in levels])
            ax.grid(alpha=0.3)
        ax_t.legend(fontsize=7)
        ax_u.legend(fontsize=7, title="vertical: capacity", title_fontsize=7)
        fig.suptitle(f"{result['options']['backend']} backend, {traffic} traffic", fontsize=10)
        fig.tight_layout()
        path = Path(json_path).with_name(f"{Path(json_path).stem}-{traffic}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(str(path))
    return paths


# What each scheme of `load` and `bench engine` measures (the summary names it).
SCHEMES = {
    "reuse": "one connection per client process, reused",
    "fresh": "a new connection per request",
    "in-process": "the same engine in the client's process, no socket",
    "project": "this project's decoder",
    "reference": "the reference scheme: 4-frame windows, one stream at a time",
    "null": "no SNAC: the engine alone",
}


def capacity_lines(result: dict[str, Any]) -> list[str]:
    """The capacities as labelled lines, under a line saying what passing means."""
    sla = result["options"]["ttfb_sla_ms"]
    lines = [
        "real-time capacity: the most concurrent streams whose point passed (every utterance finished, none "
        f"underran or was refused, p95 TTFB <= {sla:g} ms)"
    ]
    for traffic, by_scheme in result["capacity"].items():
        for scheme, cap in by_scheme.items():
            line = f"  {traffic} traffic, {scheme} ({SCHEMES.get(scheme, scheme)}): {cap['streams']:g} streams"
            if cap["rate_per_s"]:
                line += f" at {cap['rate_per_s']:.3g} arrivals/s"
            failure = cap["first_failure"]
            if failure is not None:
                noisy = " (below the capacity: a noisy sweep)" if failure < cap["streams"] else ""
                line += f"; first failing point: {failure:g} streams{noisy}"
            lines.append(line)
    return lines


def report(result: dict[str, Any], json_path: str | None) -> None:
    """Print the points and the capacities; write the JSON and, beside it, the plots."""
    print_rows(result["points"], COLUMNS)
    print()
    print("\n".join(capacity_lines(result)))
    if json_path:
        try:
            result["plots"] = write_plots(result, json_path)
        except ImportError:
            print("plots need matplotlib: pip install 'orpheus-tts-plugin[bench]'")
        write_json(result, json_path)
