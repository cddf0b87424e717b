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

# What the caller says: a question the agent answers, then a line that barges in on the answer. Each hesitates
# mid-sentence where the sentence is plainly unfinished, as callers do: the question with a filled pause ("um,"
# then silence), the barge-in with a silent one (SSML `<break>`, espeak-ng's markup, which espeak-ng speaks with
# the falling pitch of a clause's end). Both pauses outlast the VAD's stop (0.2 s), so the turn stop decides;
# a turn stop that answers there has cut the caller off (waterfall.py: split turns; turn_check.py).
CALLER_LINES = {
    "question": 'Hi, what are your opening hours on, um, <break time="300ms"/> Saturday?',
    "barge_in": 'Sorry to interrupt, can I book a table for <break time="400ms"/> two people tonight?',
}
MANIFEST = "fixtures.json"
TARGET_PEAK = 0.7  # of full scale: a loud, clean caller, well above the VAD's volume floor


def speak(text: str, voice: str = "en-us", words_per_minute: int = 165) -> np.ndarray:
    """Synthesise `text` (plain, or with SSML such as `<break time="600ms"/>`) with espeak-ng; int16 samples at
    8 kHz, peak-normalised."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng not found; install it (Debian/Ubuntu: apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(
            ["espeak-ng", "-m", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
            check=True,
            capture_output=True,
        )
        with wave.open(str(path), "rb") as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    audio = soxr.resample(pcm.astype(np.float32) / 32768.0, rate, mulaw.RATE, quality="VHQ")
    audio *= TARGET_PEAK / max(float(np.abs(audio).max()), 1e-6)
    return np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)


def make_fixtures(out_dir: str | Path, lines: dict[str, str] = CALLER_LINES) -> dict[str, bytes]:
    """Write OUT_DIR/<name>.ulaw for every line plus a manifest; return the μ-law audio by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    audio = {name: mulaw.encode(speak(text)) for name, text in lines.items()}
    manifest = {}
    for name, text in lines.items():
        (out / f"{name}.ulaw").write_bytes(audio[name])
        manifest[name] = {"text": text, "file": f"{name}.ulaw", "seconds": len(audio[name]) / mulaw.RATE}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return audio


def load_fixtures(out_dir: str | Path, lines: dict[str, str] = CALLER_LINES) -> dict[str, bytes]:
    """The fixtures in OUT_DIR, (re)generating them if missing or made from other text."""
    out = Path(out_dir)
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        if {name: entry["text"] for name, entry in manifest.items()} == lines:
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
