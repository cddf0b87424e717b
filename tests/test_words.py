"""The word-timestamp estimator (orpheus_tts_plugin/speech/words.py): weights, the full view, the incremental view."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.spec import SAMPLE_RATE
from orpheus_tts_plugin.speech.words import (
    DEFAULT_WEIGHTS,
    Pace,
    Span,
    TimedWord,
    WordTimer,
    estimate,
    spoken_form,
    total_weight,
    units,
)
from tests.stubs import SPEED_IDS, SPEEDS

FRAME = 2048


def chunks(lengths: list[int], size: int = FRAME) -> Iterator[Span]:
    """A stream of sentences of `lengths` samples, in chunks of `size`, as the engine numbers them."""
    offset = 0
    for utterance, length in enumerate(lengths):
        for at in range(0, length, size):
            n = min(size, length - at)
            yield Span(offset + at, n, utterance, at + n == length)
        offset += length


def feed_all(timer: WordTimer, stream: Iterator[Span]) -> list[tuple[int, list[TimedWord]]]:
    """(samples delivered, words given) after each chunk."""
    return [(c.start_sample + c.num_samples, timer.feed(c)) for c in stream]


# ------------------------------------------------------------------ weights
def test_an_emotion_tag_takes_audio_but_is_never_a_word():
    plain = estimate("Well hello there.", 48_000)
    tagged = estimate("Well <laugh> hello there<sigh>.", 48_000)
    assert [w.text for w in tagged] == ["Well", "hello", "there."]
    assert tagged[1].start > plain[1].start  # the laugh's audio lies between "Well" and "hello"
    assert tagged[1].start - tagged[0].end > 0


def test_numbers_and_symbols_weigh_as_they_are_read():
    assert spoken_form("1990").split() == ["nineteen", "ninety"]
    assert spoken_form("$3.50").split() == ["three", "dollars", "fifty", "cents"]
    assert spoken_form("1,200").split() == ["one", "thousand", "two", "hundred"]
    assert spoken_form("21st").split() == ["twenty", "one"]
    long_number, short_word = units("48213 ok")
    assert long_number.weight > 5 * short_word.weight


def test_punctuation_on_its_own_joins_the_word_before_it_and_adds_a_pause():
    parts = units("Wait — what?")
    assert [u.text for u in parts if u.text] == ["Wait —", "what?"]
    assert sum(u.pause for u in parts) == DEFAULT_WEIGHTS.clause_pause  # the dash's
    assert parts[-1].pause == 0  # the end of the sentence is its tail, not a pause


def test_with_the_length_known_the_words_fill_the_sentence_in_order():
    words = estimate("Thanks for calling, how can I help you today?", 72_000)
    assert [w.text for w in words][:3] == ["Thanks", "for", "calling,"]
    assert words[0].start == 0
    assert all(a.end <= b.start for a, b in zip(words, words[1:]))
    assert words[-1].end == 72_000 - round(DEFAULT_WEIGHTS.trail_s * SAMPLE_RATE)
    assert words[3].start - words[2].end > words[2].start - words[1].end  # the comma's pause
    assert estimate("", 1000) == [] and estimate("<laugh>", 1000) == []


# ------------------------------------------------------------------ incremental
@pytest.mark.parametrize(
    "seconds_per_unit", [0.02, 0.056, 0.2], ids=["prior-too-fast", "prior-right", "prior-too-slow"]
)
def test_each_word_is_given_once_in_order_after_its_estimated_end_is_delivered(seconds_per_unit: float):
    sentences = ["Hello there, how are you?", "I am fine <laugh> thanks.", "Bye."]
    pace = Pace(replace(DEFAULT_WEIGHTS, seconds_per_unit=seconds_per_unit))
    timer = WordTimer(sentences, pace)
    lengths = [40_000, 50_000, 9_000]
    given = feed_all(timer, chunks(lengths))
    words = [w for _, ws in given for w in ws]
    assert [w.text for w in words] == "Hello there, how are you? I am fine thanks. Bye.".split()
    for delivered, ws in given:
        assert all(w.end <= delivered for w in ws), "a word given before its estimated end was delivered"
    assert all(a.start <= b.start and a.start <= a.end for a, b in zip(words, words[1:]))
    bounds, first = [0, 40_000, 90_000, 99_000], 0
    for i, sentence in enumerate(sentences):  # each sentence's words lie inside its own audio
        count = len([u for u in units(sentence) if u.text is not None])
        mine, first = words[first : first + count], first + count
        assert bounds[i] <= mine[0].start and mine[-1].end <= bounds[i + 1]


def test_words_not_given_before_the_end_are_timed_with_the_sentences_length():
    text, length = "This sentence is only timed once its last chunk is in.", 96_000
    slow = Pace(replace(DEFAULT_WEIGHTS, seconds_per_unit=10.0))  # the prior never places a word in time
    given = feed_all(WordTimer([text], slow), chunks([length]))
    assert all(not ws for _, ws in given[:-1])
    assert given[-1][1] == estimate(text, length)  # exactly the full view


def test_the_rest_of_a_sentence_is_re_timed_after_the_words_already_given():
    text, length = "One two three four five six seven eight nine ten.", 40_000
    slow = Pace(replace(DEFAULT_WEIGHTS, seconds_per_unit=0.045))  # the last words still ahead of it at the end
    given = feed_all(WordTimer([text], slow), chunks([length]))
    early = [w for _, ws in given[:-1] for w in ws]
    late = given[-1][1]
    assert early and late
    assert late[0].start >= early[-1].end
    tail = round(DEFAULT_WEIGHTS.trail_s * SAMPLE_RATE)
    assert late[-1].end == (length - tail if early[-1].end < length - tail else length)


def test_holding_words_gives_fewer_of_them_by_the_prior():
    text, length = "A fairly long sentence with quite a few words that go on and on for a while.", 100_000
    early = []
    for hold in (0.0, 1.0):
        given = feed_all(WordTimer([text], Pace(), hold_s=hold), chunks([length]))
        early.append(sum(len(ws) for _, ws in given[:-1]))
    assert early[0] > early[1]


def test_the_pace_learns_the_voices_speaking_rate_from_each_finished_sentence():
    pace = Pace()
    prior = pace.samples_per_unit
    text = "A sentence spoken at half the prior's speed."
    heard = total_weight(units(text)) * prior * 2
    for _ in range(6):
        feed_all(WordTimer([text], pace), chunks([round(heard + DEFAULT_WEIGHTS.trail_s * SAMPLE_RATE)]))
    assert pace.samples_per_unit == pytest.approx(2 * prior, rel=0.05)


# ------------------------------------------------------------------ on the engine's own chunks
@pytest.fixture(scope="module", params=list(SPEEDS.values()), ids=SPEED_IDS)
def engine(request: pytest.FixtureRequest, synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    config = replace(synthetic_config, synthetic=SyntheticConfig(tokens_per_second=request.param))
    eng = OrpheusEngine(config)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.aclose())


async def test_an_engine_streams_words_come_out_in_order_inside_each_sentences_audio(engine: OrpheusEngine):
    text = "Hello <laugh> there. We are open from 9 to 5 on weekdays, and 10 to 4 on Saturdays."
    sentences = engine.sentences(text)
    timer, words, spans = WordTimer(sentences), [], {}
    async for chunk in engine.synthesize(text, seed=1):
        got = timer.feed(chunk)
        assert all(w.end <= chunk.start_sample + chunk.num_samples for w in got)
        words += [(chunk.utterance, w) for w in got]
        first, _ = spans.get(chunk.utterance, (chunk.start_sample, 0))
        spans[chunk.utterance] = (first, chunk.start_sample + chunk.num_samples)
    assert " ".join(w.text for _, w in words) == text.replace("<laugh> ", "")
    for utterance, w in words:
        first, last = spans[utterance]
        assert first <= w.start <= w.end <= last


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")
def test_on_espeak_speech_the_defaults_beat_an_equal_share_per_word(tmp_path: Path, run_script: Callable[..., Any]):
    out = tmp_path / "accuracy.json"
    run_script("word_timing_accuracy.py", "--json", str(out), check=True, timeout=300)
    import json

    views = {v["view"]: v for v in json.loads(out.read_text())["views"]}
    full, baseline = views["full (length known)"], views["baseline: equal share per word"]
    assert full["mean"] < 0.5 * baseline["mean"]
    assert views["incremental, pace learnt"]["mean"] < views["incremental, prior only"]["mean"]
