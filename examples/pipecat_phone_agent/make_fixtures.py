"""Caller speech fixtures: text → espeak-ng → 8 kHz μ-law, the audio the simulated caller streams to the agent.

    python -m examples.pipecat_phone_agent.make_fixtures OUT_DIR

needs the `espeak-ng` program (Debian/Ubuntu: `apt-get install espeak-ng`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import soxr

from . import mulaw

# What the caller says: a question the agent answers, then a line that barges in on the answer.
CALLER_LINES = {
    "question": "Hi, what are your opening hours on Saturday?",
    "barge_in": "Sorry to interrupt, can I book a table for two people tonight?",
}
MANIFEST = "fixtures.json"
TARGET_PEAK = 0.7  # of full scale: a loud, clean caller, well above the VAD's volume floor
# Each line is one turn: no pause inside it may be long enough for the VAD to end speech (the agent's
# vad_stop_secs is 0.2 s). espeak-ng pauses up to ~0.21 s at a comma; a pause the VAD could end speech at
# lets a server that lags behind real time end the turn there, so a split would depend on host speed.
MAX_PAUSE_S = 0.08
QUIET_RMS = 0.01  # of full scale, over 10 ms: below this the line is pausing


def speak(text: str, voice: str = "en-us", words_per_minute: int = 165) -> np.ndarray:
    """Synthesise `text` with espeak-ng; int16 samples at 8 kHz, peak-normalised."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng not found; install it (Debian/Ubuntu: apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
            check=True,
            capture_output=True,
        )
        with wave.open(str(path), "rb") as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = soxr.resample(pcm.astype(np.float32) / 32768.0, rate, mulaw.RATE, quality="VHQ")
    audio *= TARGET_PEAK / max(float(np.abs(audio).max()), 1e-6)
    audio = shorten_pauses(audio, mulaw.RATE)
    return np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)


def pause_runs(audio: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """(start, end) sample ranges of the pauses inside the speech (quiet 10 ms RMS), leading and trailing excluded."""
    window = max(1, rate // 100)
    rms = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(window) / window, "same"))
    loud = np.flatnonzero(rms >= QUIET_RMS)
    if loud.size == 0:
        return []
    quiet = np.r_[False, rms[loud[0] : loud[-1] + 1] < QUIET_RMS, False].astype(np.int8)
    edges = np.flatnonzero(np.diff(quiet))
    return [(loud[0] + a, loud[0] + b) for a, b in zip(edges[::2], edges[1::2])]


def shorten_pauses(audio: np.ndarray, rate: int, max_pause_s: float = MAX_PAUSE_S) -> np.ndarray:
    """`audio` with every pause inside the speech cut to at most `max_pause_s` (its middle removed)."""
    keep = int(max_pause_s * rate)
    cuts = [(a + keep // 2, b - (keep - keep // 2)) for a, b in pause_runs(audio, rate) if b - a > keep]
    if not cuts:
        return audio
    pieces, at = [], 0
    for a, b in cuts:
        pieces.append(audio[at:a])
        at = b
    pieces.append(audio[at:])
    return np.concatenate(pieces)


def make_fixtures(out_dir: str | Path, lines: dict[str, str] = CALLER_LINES) -> dict[str, bytes]:
    """Write OUT_DIR/<name>.ulaw for every line plus a manifest; return the μ-law audio by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    audio = {name: mulaw.encode(speak(text)) for name, text in lines.items()}
    manifest = {}
    for name, text in lines.items():
        (out / f"{name}.ulaw").write_bytes(audio[name])
        manifest[name] = {
            "text": text,
            "file": f"{name}.ulaw",
            "seconds": len(audio[name]) / mulaw.RATE,
            "max_pause_s": MAX_PAUSE_S,
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return audio


def load_fixtures(out_dir: str | Path, lines: dict[str, str] = CALLER_LINES) -> dict[str, bytes]:
    """The fixtures in OUT_DIR, (re)generating them if missing or made from other text."""
    out = Path(out_dir)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        made = {name: (entry["text"], entry.get("max_pause_s")) for name, entry in manifest.items()}
        if made == {name: (text, MAX_PAUSE_S) for name, text in lines.items()}:
            return {name: (out / entry["file"]).read_bytes() for name, entry in manifest.items()}
    except (OSError, ValueError, KeyError):
        pass
    return make_fixtures(out, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default="out/phone-agent/fixtures")
    args = parser.parse_args(argv)
    audio = make_fixtures(args.out_dir)
    for name, data in audio.items():
        print(f"{Path(args.out_dir) / (name + '.ulaw')}: {len(data) / mulaw.RATE:.2f} s of 8 kHz μ-law")
    return 0


if __name__ == "__main__":
    sys.exit(main())
