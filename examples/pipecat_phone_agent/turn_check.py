"""Smart-turn v3 on the caller's own lines: what it decides at each pause, and what each decision costs.

    python -m examples.pipecat_phone_agent.turn_check [--fixtures out/phone-agent/fixtures] [--repeats 5]

Plays each caller line (make_fixtures.py: every line pauses mid-sentence) through Pipecat's
`LocalSmartTurnAnalyzerV3` (the ONNX model in Pipecat's wheel, one thread, as `--turn-stop smart` runs it) the
way `TurnAnalyzerUserTurnStopStrategy` does: 20 ms frames, and at every silence of `--vad-stop-secs` (the VAD's
stop) the model is asked whether the turn is over. A "complete" at a mid-sentence pause is a turn ended too
early (the agent would answer half a question); an "incomplete" at the line's end leaves the turn to the
analyzer's 3 s silence fallback. Prints each decision, its probability, and the CPU time and wall time of each
inference on this host; no server, so a busy host moves the times but not the decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr

from . import mulaw
from .make_fixtures import load_fixtures

RATE = 16_000  # what the pipeline feeds the turn analyzer (bot.PIPELINE_IN_RATE)
FRAME_S = 0.02
SPEECH_PEAK = 0.02  # of full scale: a frame louder than this is speech (espeak-ng's silences are digital zero)


@dataclass(frozen=True)
class Decision:
    """The model asked at one pause of a line."""

    line: str
    at_s: float  # where the speech before the pause ends, seconds into the line
    final: bool  # the line's end (True) or a pause inside it
    complete: bool
    probability: float
    cpu_ms: float  # this process's CPU time for the inference (all threads)
    wall_ms: float


def frames_of(ulaw: bytes) -> list[np.ndarray]:
    """The line as 20 ms int16 frames at 16 kHz, then 1 s of silence (the caller waiting for the answer)."""
    pcm = mulaw.decode(ulaw).astype(np.float32) / 32768.0
    audio = soxr.resample(pcm, mulaw.RATE, RATE)
    audio = np.concatenate([audio, np.zeros(RATE, dtype=np.float32)])
    n = int(RATE * FRAME_S)
    return [np.round(audio[i : i + n] * 32767).astype(np.int16) for i in range(0, len(audio) - n + 1, n)]


async def decisions_of(name: str, ulaw: bytes, vad_stop_s: float) -> list[Decision]:
    """Feed one line to a fresh analyzer; ask the model at each silence of `vad_stop_s` after speech."""
    from pipecat.audio.turn.base_turn_analyzer import EndOfTurnState
    from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

    analyzer = LocalSmartTurnAnalyzerV3()
    analyzer.set_sample_rate(RATE)
    voiced_end_s = mulaw.voiced_until(ulaw)
    out: list[Decision] = []
    silence_s, spoke, asked, last_voice_s = 0.0, False, False, 0.0
    try:
        for i, frame in enumerate(frames_of(ulaw)):
            is_speech = float(np.abs(frame).max()) / 32768.0 > SPEECH_PEAK
            analyzer.append_audio(frame.tobytes(), is_speech)
            if is_speech:
                spoke, asked, silence_s, last_voice_s = True, False, 0.0, (i + 1) * FRAME_S
                continue
            silence_s += FRAME_S
            if spoke and not asked and silence_s >= vad_stop_s - 1e-9:
                asked = True
                cpu, wall = time.process_time(), time.perf_counter()
                state, _metrics = await analyzer.analyze_end_of_turn()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                probability = getattr(_metrics, "probability", float("nan"))
                final = abs(last_voice_s - voiced_end_s) < 0.1
                complete = state == EndOfTurnState.COMPLETE
                out.append(Decision(name, last_voice_s, final, complete, probability, cpu * 1e3, wall * 1e3))
                if complete:
                    break
    finally:
        await analyzer.cleanup()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", default="out/phone-agent/fixtures")
    parser.add_argument("--repeats", type=int, default=5, help="times each line is played (for the timings)")
    parser.add_argument("--vad-stop-secs", type=float, default=0.2)
    args = parser.parse_args(argv)
    lines = load_fixtures(Path(args.fixtures))
    runs = [
        d for _ in range(args.repeats) for name, ulaw in lines.items()
        for d in asyncio.run(decisions_of(name, ulaw, args.vad_stop_secs))
    ]  # fmt: skip
    print(f"{'line':<10}{'speech ends s':>14}{'where':>14}{'decision':>12}{'p(complete)':>13}")
    for d in runs[: len(runs) // args.repeats]:
        where = "line end" if d.final else "mid-sentence"
        print(f"{d.line:<10}{d.at_s:>14.2f}{where:>14}{'complete' if d.complete else 'wait':>12}{d.probability:>13.3f}")
    early = sum(d.complete and not d.final for d in runs)
    missed = sum(not d.complete and d.final for d in runs)
    pauses = sum(not d.final for d in runs)
    print(f"ended too early: {early} of {pauses} mid-sentence pauses; line ends judged unfinished: {missed}")
    cpu, wall = [d.cpu_ms for d in runs], [d.wall_ms for d in runs]
    print(
        f"per inference ({len(runs)}): CPU median {statistics.median(cpu):.1f} ms (max {max(cpu):.1f}), "
        f"wall median {statistics.median(wall):.1f} ms (max {max(wall):.1f}); one thread (Pipecat's cpu_count=1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
