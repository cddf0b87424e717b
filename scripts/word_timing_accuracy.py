"""How far the word-timestamp estimate (orpheus_tts_plugin/speech/words.py) is from real word times.

espeak-ng speaks a corpus of phone-agent sentences (short, long, with numbers, with commas) at several
rates, and reports through libespeak-ng's word events (`espeakEVENT_WORD`, sample-accurate) where each
word starts. The estimator is scored against those starts two ways:

- full: given the sentence's true length (what it does once the sentence's last chunk is in);
- incremental: fed the audio in 2,048-sample chunks (one Orpheus frame), the way the adapters use it,
  each word scored at the time it was given out (by the speaking-rate prior, or re-timed at the end).

It first compares weighting schemes (syllables, letters, one per word; a constant per word; pauses after
punctuation) by the mean full-view error, then reports the defaults in detail.

    .venv/bin/python scripts/word_timing_accuracy.py [--json out/word-timing.json]

Needs espeak-ng (`apt-get install espeak-ng`). espeak is a formant synthesiser, not Orpheus: its pauses
and rhythm are rule-made, so the figures say how well the weights follow English word lengths, not
Orpheus's own prosody.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import itertools
import json
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.words import (
    DEFAULT_WEIGHTS,
    Pace,
    Span,
    Weights,
    WordTimer,
    estimate,
    total_weight,
    units,
)

CORPUS: dict[str, list[str]] = {
    "short": [
        "Hello there.",
        "Thanks for calling.",
        "How can I help?",
        "Sure, one moment.",
        "That works for me.",
        "Goodbye for now.",
        "I can do that.",
        "Sorry, say again?",
        "Yes, we are open.",
        "Have a lovely day.",
    ],
    "long": [
        "Our clinic is open on weekdays from the early morning until the late evening, and a nurse is "
        "always on call for anything that cannot wait until the next appointment.",
        "If you would like to change your booking, I can move it to another day this week or next week, "
        "whichever suits you better, and send you a confirmation by text message.",
        "The delivery should reach you tomorrow afternoon, but the courier sometimes runs late on Fridays "
        "because of the traffic around the city centre.",
        "Let me check that for you now, it will only take a moment while I look up your account and the "
        "most recent payments that went through.",
        "We recommend arriving about fifteen minutes before your appointment so that there is enough time "
        "to fill in the forms and find a parking space.",
        "I understand how frustrating that must be, and I will make sure that the manager hears about it "
        "first thing tomorrow morning.",
        "The new menu has several vegetarian dishes, a few gluten free options, and a children's section "
        "with smaller portions at lower prices.",
        "Unfortunately the item you ordered is out of stock at the moment, although we expect a new "
        "shipment from the supplier at the end of the month.",
    ],
    "numbers": [
        "Your order number is 48213.",
        "The total comes to $37.50 including tax.",
        "We open at 9:30 and close at 17:45.",
        "The building was finished in 1998 and renovated in 2015.",
        "Please call 555 0199 after 6 in the evening.",
        "You have 3 messages and 12 missed calls.",
        "The flight leaves on the 21st at 7:15 in the morning.",
        "It costs $1,250 for 2 nights, or $600 a night.",
        "About 85% of our customers renew after 12 months.",
        "Room 204 is on the 2nd floor, next to room 206.",
    ],
    "sentences": [
        "Thanks for calling. How can I help you today?",
        "I see. Let me check. One moment, please.",
        "Yes. That is fine. See you on Monday!",
        "Great news! Your parcel arrived this morning. It is at the front desk.",
        "No problem at all. I have cancelled it. Is there anything else?",
        "Okay. Your table for 4 is booked at 8. Enjoy your evening!",
        "Hello? Are you still there? I cannot hear you very well.",
        "Done. I sent the receipt to your email. It should arrive shortly.",
    ],
    "commas": [
        "Well, to be honest, I am not completely sure.",
        "First, check the cable; then, restart the router.",
        "On Monday, Tuesday, and Wednesday, we close early.",
        "Yes, of course, I can book that for you.",
        "If it rains, the match is cancelled, unfortunately.",
        "Bring your passport, your ticket, and a pen.",
        "Hmm, let me think, that might take a while.",
        "Actually, no, the office moved last year.",
        "Okay, great, see you then.",
        "Right, so, the next step is payment.",
    ],
}
RATES_WPM = (140, 175, 220)  # espeak-ng's speaking rates; 175 is its default
CHUNK = 2048  # samples per Orpheus frame, the engine's chunk after the first


# ---------------------------------------------------------------------------------------------- espeak-ng
class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))
_EVENT_WORD, _AUDIO_OUTPUT_SYNCHRONOUS, _POS_CHARACTER = 1, 2, 1


@dataclass(frozen=True)
class Spoken:
    """One sentence spoken by espeak-ng: its length and its words' starts, in 24 kHz samples."""

    text: str
    category: str
    wpm: int
    num_samples: int
    starts: list[int | None]  # None: espeak gave no start of its own for this word


class Espeak:
    """libespeak-ng in synchronous mode: the audio and the word events of one text at a time."""

    def __init__(self, voice: str = "en-us"):
        name = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        self._lib = ctypes.CDLL(name)
        self.rate = self._lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, 0)
        if self.rate <= 0:
            raise RuntimeError("espeak_Initialize failed")
        self._lib.espeak_SetVoiceByName(voice.encode())
        self._samples = 0
        self._events: list[tuple[int, int]] = []  # (text position, sample) of each word event
        self._callback = _CALLBACK(self._on_synth)  # kept: libespeak holds the pointer
        self._lib.espeak_SetSynthCallback(self._callback)

    def _on_synth(self, _wav, count: int, events) -> int:
        self._samples += max(count, 0)
        i = 0
        while events[i].type != 0:
            if events[i].type == _EVENT_WORD:
                self._events.append((events[i].text_position - 1, events[i].sample))
            i += 1
        return 0

    def speak(self, text: str, wpm: int, category: str) -> Spoken:
        """Word starts per whitespace token (the earliest word event inside it: a number is several words)."""
        self._lib.espeak_SetParameter(1, wpm, 0)  # espeakRATE
        self._samples, self._events = 0, []
        data = text.encode()
        self._lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, 0, None, None)
        self._lib.espeak_Synchronize()
        to_24k = SAMPLE_RATE / self.rate
        tokens = [m.end() for m in re.finditer(r"\S+", text)]
        found: dict[int, int] = {}
        for pos, sample in self._events:  # an event on the space before a token belongs to that token
            i = next((i for i, end in enumerate(tokens) if pos >= 0 and end > pos), None)
            if i is not None:
                found[i] = min(found.get(i, sample), sample)
        # espeak joins some unstressed words (the, a, be) to the next one, with one event for both:
        # neither has a known start then.
        starts = [
            round(found[i] * to_24k) if i in found and (i == 0 or i - 1 in found) else None for i in range(len(tokens))
        ]
        return Spoken(text, category, wpm, round(self._samples * to_24k), starts)


# ---------------------------------------------------------------------------------------------- scoring


def full_errors(spoken: list[Spoken], weights: Weights) -> list[float]:
    """|estimated - true| word start, ms, with each sentence's length known."""
    out = []
    for s in spoken:
        words = estimate(s.text, s.num_samples, weights)
        assert len(words) == len(s.starts), s.text
        out += _errors(words, s.starts)
    return out


def _errors(words, starts: list[int | None]) -> list[float]:
    return [abs(w.start - t) * 1000 / SAMPLE_RATE for w, t in zip(words, starts) if t is not None]


def incremental_errors(
    spoken: list[Spoken], weights: Weights, learn: bool, hold_s: float = 0.0
) -> tuple[list[float], float]:
    """Errors of the words as given out chunk by chunk, and the share given before the sentence ended.

    `learn`: one Pace across the sentences of a rate (a call's voice learnt); else a fresh prior each time.
    """
    out, early, total = [], 0, 0
    paces: dict[int, Pace] = {}
    for s in spoken:
        pace = paces.setdefault(s.wpm, Pace(weights)) if learn else Pace(weights)
        timer = WordTimer([s.text], pace, hold_s)
        given = []
        for start in range(0, s.num_samples, CHUNK):
            n = min(CHUNK, s.num_samples - start)
            words = timer.feed(Span(start, n, utterance_end=start + n >= s.num_samples))
            if start + n < s.num_samples:
                early += len(words)
            given += words
        assert len(given) == len(s.starts), s.text
        total += len(given)
        out += _errors(given, s.starts)
    return out, early / total


def stats(errors: list[float]) -> dict[str, float]:
    q = statistics.quantiles(errors, n=10)
    return {"n": len(errors), "mean": statistics.fmean(errors), "median": statistics.median(errors), "p90": q[-1]}


def schemes() -> list[Weights]:
    """The candidates compared: each unit with a grid of per-word constants and pauses (in that unit)."""
    grid = {  # unit: (per-word constants, clause pauses, sentence pauses), in that unit
        "characters": ((0, 0.5, 1, 1.5, 2, 3), (2, 3, 4, 5, 6, 8), (0, 3, 6, 9, 12)),
        "syllables": ((0, 0.25, 0.5, 1), (0.5, 1, 1.5, 2, 3), (0, 1, 2, 3, 4)),
        "words": ((0,), (0, 0.5, 1, 1.5, 2), (0, 1, 2, 3)),
    }
    return [
        Weights(unit=unit, per_word=per_word, clause_pause=clause, stop_pause=stop, trail_s=trail)
        for unit, axes in grid.items()
        for per_word, clause, stop, trail in itertools.product(*axes, (0.0, 0.1, 0.2))
    ]


def label(w: Weights) -> str:
    return f"{w.unit}, +{w.per_word:g}/word, pauses {w.clause_pause:g} (,) {w.stop_pause:g} (.), tail {w.trail_s:g} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every figure here too")
    args = parser.parse_args(argv)

    espeak = Espeak()
    spoken = [espeak.speak(t, wpm, c) for wpm in RATES_WPM for c, texts in CORPUS.items() for t in texts]
    words = sum(len(s.starts) for s in spoken)
    scored = sum(t is not None for s in spoken for t in s.starts)
    print(f"{len(spoken)} sentences, {words} words, {scored} with a start of their own (espeak-ng, {RATES_WPM} wpm)\n")

    ranked = sorted(((statistics.fmean(full_errors(spoken, w)), w) for w in schemes()), key=lambda x: x[0])
    print("best schemes by mean word-start error, length known (ms):")
    best_by_unit: dict[str, tuple[float, Weights]] = {}
    for mean, w in ranked:
        best_by_unit.setdefault(w.unit, (mean, w))
    for mean, w in ranked[:5]:
        print(f"  {mean:7.1f}  {label(w)}")
    print("best of each unit:")
    for mean, w in best_by_unit.values():
        print(f"  {mean:7.1f}  {label(w)}")

    # The prior: the defaults' seconds per unit at espeak's default rate (what the incremental view starts from).
    at_default = [s for s in spoken if s.wpm == 175]
    per_unit = statistics.median(s.num_samples / SAMPLE_RATE / total_weight(units(s.text)) for s in at_default)
    print(
        f"\ndefaults: {label(DEFAULT_WEIGHTS)}; prior {DEFAULT_WEIGHTS.seconds_per_unit:g} s/unit "
        f"(median at 175 wpm: {per_unit:.3f})"
    )
    report: dict[str, object] = {"sentences": len(spoken), "words": words, "scored": scored, "rates_wpm": RATES_WPM}
    rows = []
    for view, errors, early in _views(spoken):
        row = {"view": view, **stats(errors), "given_before_end": early}
        rows.append(row)
        for category in CORPUS:
            subset = [s for s in spoken if s.category == category]
            row[category] = stats(next(e for v, e, _ in _views(subset) if v == view))["mean"]
    print(f"{'view':<34}{'mean':>7}{'median':>8}{'p90':>7}{'early':>7}  " + "".join(f"{c:>10}" for c in CORPUS))
    for r in rows:
        print(
            f"{r['view']:<34}{r['mean']:7.1f}{r['median']:8.1f}{r['p90']:7.1f}{r['given_before_end']:7.0%}  "
            + "".join(f"{r[c]:10.1f}" for c in CORPUS)
        )
    report["views"] = rows
    report["ranking"] = [{"mean_ms": m, "scheme": label(w)} for m, w in ranked[:10]]
    report["best_by_unit"] = {u: {"mean_ms": m, "scheme": label(w)} for u, (m, w) in best_by_unit.items()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _views(spoken: list[Spoken]):
    """(name, errors, share given before the end) for each way of using the defaults."""
    yield "full (length known)", full_errors(spoken, DEFAULT_WEIGHTS), 0.0
    for learn, hold, name in (
        (False, 0.0, "incremental, prior only"),
        (True, 0.0, "incremental, pace learnt"),
        (True, 0.5, "incremental, learnt, hold 0.5 s"),
        (True, 1.0, "incremental, learnt, hold 1 s"),
    ):
        errors, early = incremental_errors(spoken, DEFAULT_WEIGHTS, learn, hold)
        yield name, errors, early
    even = replace(DEFAULT_WEIGHTS, unit="words", per_word=0.0, clause_pause=0.0, stop_pause=0.0)
    yield "baseline: equal share per word", full_errors(spoken, even), 0.0


if __name__ == "__main__":
    sys.exit(main())
