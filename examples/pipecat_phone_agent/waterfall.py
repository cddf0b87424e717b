"""The latency waterfall: each turn's stages in ms from the caller's speech end, their medians, and a chart.

The server's moments (latency.py, `GET /calls/{stream_sid}/moments`) and the caller's clock are both
`time.monotonic()`, so they line up directly.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

# The stages of report.json's "stages_ms", in the order the issue names them (latency.py says what each is).
STAGES = (
    "turn_end",
    "transcript",
    "llm_first_token",
    "first_phrase_ready",
    "tts_first_audio",
    "transport_out",
    "caller_first_audio",
)
EXTRA_STAGES = ("vad_stop", "turn_confirmed")
# As they usually follow each other: the turn end waits for the transcript.
CHRONOLOGY = (
    "vad_stop",
    "transcript",
    "turn_end",
    "llm_first_token",
    "first_phrase_ready",
    "turn_confirmed",
    "tts_first_audio",
    "transport_out",
    "caller_first_audio",
)


def stages_ms(moments: list[list[Any]], speech_end: float, caller_first_audio: float | None) -> dict[str, float | None]:
    """Milliseconds from the caller's speech end to each stage of the reply that followed it.

    Each stage is its first moment after the stage that causes it (the VAD stop and the turn end only need
    to follow the speech end). The transcript is the last one between the VAD stop and the turn end: a line
    the VAD heard as two segments has two, and the turn waits for the second.
    """
    ordered = sorted(moments)

    def first(stage: str, after: float | None) -> float | None:
        if after is None:
            return None
        return next((t for t, s in ordered if s == stage and t >= after), None)

    at: dict[str, float | None] = {s: first(s, speech_end) for s in ("vad_stop", "turn_end")}
    at["transcript"] = first("transcript", at["vad_stop"])
    if at["transcript"] is not None and at["turn_end"] is not None:
        before_end = [t for t, s in ordered if s == "transcript" and at["transcript"] <= t <= at["turn_end"]]
        at["transcript"] = max(before_end, default=at["transcript"])
    at["llm_first_token"] = first("llm_first_token", at["turn_end"])
    at["first_phrase_ready"] = first("first_phrase_ready", at["llm_first_token"])
    at["turn_confirmed"] = first("turn_confirmed", at["turn_end"])
    at["tts_first_audio"] = first("tts_first_audio", at["first_phrase_ready"] or at["llm_first_token"])
    at["transport_out"] = first("transport_out", at["tts_first_audio"])
    at["caller_first_audio"] = caller_first_audio
    return {s: None if at[s] is None else round((at[s] - speech_end) * 1000.0, 1) for s in (*STAGES, *EXTRA_STAGES)}


def add_stages(report: dict[str, Any], moments_of: dict[str, list[list[Any]]]) -> None:
    """Give every turn of `report` its "stages_ms", from its call's moments (by stream sid), every call its
    speculations (turns ended at the VAD stop with the reply held: confirmed, or discarded as the caller went on) and
    the number of user turns the server ended and answered ("server_turn_ends": more than the caller's turns means
    one was split; a discarded speculation was never heard, so it splits nothing).
    """
    for call in report["calls"]:
        moments = moments_of.get(call.get("stream_sid", ""), [])
        count = {name: sum(stage == name for _, stage in moments) for name in ("turn_end", "speculation")}
        confirmed = sum(stage == "turn_confirmed" for _, stage in moments)
        call["speculations"] = {
            "started": count["speculation"],
            "confirmed": confirmed,
            "discarded": count["speculation"] - confirmed,
        }
        call["server_turn_ends"] = count["turn_end"] - count["speculation"] + confirmed
        call["moments"] = moments
        for turn in call["turns"]:
            turn["stages_ms"] = stages_ms(moments, turn["speech_end_monotonic"], turn["first_audio_monotonic"])


def split_turns(report: dict[str, Any]) -> int:
    """User turns the server ended beyond the caller's own, over all calls: each is a turn ended too early, at a
    pause inside the caller's sentence (the caller's lines pause mid-sentence: make_fixtures.py)."""
    return sum(max(0, c.get("server_turn_ends", 0) - len(c["turns"])) for c in report["calls"])


def speculations(report: dict[str, Any]) -> dict[str, int]:
    """Speculations started, confirmed and discarded, over all calls."""
    keys = ("started", "confirmed", "discarded")
    return {k: sum(c.get("speculations", {}).get(k, 0) for c in report["calls"]) for k in keys}


def medians(report: dict[str, Any]) -> dict[str, float | None]:
    """Each stage's median over all turns (ms from the caller's speech end)."""
    turns = [t["stages_ms"] for c in report["calls"] for t in c["turns"] if "stages_ms" in t]
    out = {}
    for stage in CHRONOLOGY:
        values = [t[stage] for t in turns if t.get(stage) is not None]
        out[stage] = round(statistics.median(values), 1) if values else None
    return out


def print_medians(columns: dict[str, dict[str, float | None]]) -> None:
    """Stage medians, one column per run (e.g. in-process and serve)."""
    print(f"{'median ms from caller speech end':<34}" + "".join(f"{name:>12}" for name in columns))
    for stage in CHRONOLOGY:
        cells = [columns[name].get(stage) for name in columns]
        print(f"{stage:<34}" + "".join(f"{'-' if v is None else f'{v:.0f}':>12}" for v in cells))


def plot(report: dict[str, Any], path: Path, title: str = "") -> None:
    """Stacked bars per turn: each segment runs from the stage reached before it up to the stage it is named after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [(f"call {c['call']}\n{t['said']}", t["stages_ms"]) for c in report["calls"] for t in c["turns"]]
    shown = CHRONOLOGY
    colors = dict(zip(shown, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(turns)), 4.5))
    for x, (_, stages) in enumerate(turns):
        reached = sorted((v, s) for s, v in stages.items() if s in shown and v is not None)
        below = 0.0
        for value, stage in reached:  # each bar segment: from the stage reached before to this one
            ax.bar(x, max(value - below, 0.0), bottom=below, color=colors[stage], width=0.7)
            below = max(below, value)
    ax.set_xticks(range(len(turns)), [label for label, _ in turns], fontsize=8)
    ax.set_ylabel("ms after the caller stops speaking")
    ax.set_title(title or "where the time to the agent's first audio goes, per turn")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in shown]
    ax.legend(handles, [f"… {s}" for s in shown], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
