"""The phone agent's latency budget (issue 37): the offline responder's LLM pace, and which turn stop is the default.

Structure only: the pace is checked on its schedule and on a real pipeline's frames (an interruption stops the
answer where it is), never by timing; smart-turn's decisions are the model's on the caller's own lines.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.frames.frames import (
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
)
from pipecat.processors.aggregators.llm_context import LLMContext

from examples.pipecat_phone_agent.config import parse_args
from examples.pipecat_phone_agent.offline_responder import RULES, LLMPace, OfflineResponder
from tests.adapters.test_pipecat import running_pipeline
from tests.examples.test_phone_agent import needs_espeak

ANSWER = RULES[0][1]


def test_the_responder_s_first_piece_comes_at_its_ttft_and_each_next_one_its_tokens_later():
    pace = LLMPace(ttft_s=0.25, tokens_per_s=50.0)
    schedule = pace.schedule(ANSWER)
    assert "".join(piece for _, piece in schedule) == ANSWER and len(schedule) == len(ANSWER.split())
    assert schedule[0][0] == pytest.approx(0.25 + (pace.tokens_in(schedule[0][1]) - 1) / 50.0)
    for (before, _), (at, piece) in zip(schedule, schedule[1:], strict=False):
        assert at - before == pytest.approx(pace.tokens_in(piece) / 50.0)
    total = sum(pace.tokens_in(p) for _, p in schedule)
    assert schedule[-1][0] == pytest.approx(0.25 + (total - 1) / 50.0)
    assert pace.tokens_in("weekdays. ") == 3 and pace.tokens_in("a ") == 1  # ~4 characters a token
    with pytest.raises(ValueError):
        LLMPace(ttft_s=-1.0)
    with pytest.raises(ValueError):
        LLMPace(tokens_per_s=0.0)


def test_the_pace_defaults_to_the_cited_figure_and_flags_change_it():
    default = parse_args([])
    assert (default.llm_ttft_s, default.llm_tokens_per_s) == (LLMPace().ttft_s, LLMPace().tokens_per_s)
    config = parse_args(["--llm-ttft", "0.4", "--llm-tokens-per-s", "120", "--first-phrase-words", "3"])
    assert (config.llm_ttft_s, config.llm_tokens_per_s, config.first_phrase_words) == (0.4, 120.0, 3)
    assert default.first_phrase_words is None  # speech from the first phrase is off by default


async def test_an_interruption_stops_the_paced_answer_where_it_is():
    responder = OfflineResponder(LLMPace(ttft_s=0.0, tokens_per_s=20.0))  # ~1.5 s for the answer's ~30 tokens
    context = LLMContext([{"role": "user", "content": "what are your opening hours"}])
    async with running_pipeline(responder) as p:
        await p.send(LLMContextFrame(context))
        await p.down.wait_for(lambda f: isinstance(f, LLMTextFrame))
        await p.send(InterruptionFrame())
        await p.down.wait_for(lambda f: isinstance(f, InterruptionFrame))
        pieces = len(p.down.of_type(LLMTextFrame))
        await p.send(LLMContextFrame(context))  # the next turn is answered whole
        await p.down.wait_for(lambda f: isinstance(f, LLMFullResponseEndFrame), timeout=30)
    frames = p.down.received()
    cut = frames.index(next(f for f in frames if isinstance(f, InterruptionFrame)))
    assert 1 <= pieces < len(ANSWER.split())
    after = [f for f in frames[cut:] if isinstance(f, (LLMFullResponseStartFrame, LLMTextFrame))]
    assert isinstance(after[0], LLMFullResponseStartFrame)  # nothing of the interrupted answer after the cut
    assert "".join(f.text for f in after[1:]) == ANSWER


@needs_espeak
def test_the_turn_stop_default_stays_the_timer_as_smart_turn_ends_the_caller_s_mid_sentence_pauses(tmp_path):
    from examples.pipecat_phone_agent.make_fixtures import make_fixtures
    from examples.pipecat_phone_agent.turn_check import decisions_of

    assert parse_args([]).turns.stop == "timeout"
    lines = make_fixtures(tmp_path)
    decisions = [d for name, ulaw in lines.items() for d in asyncio.run(decisions_of(name, ulaw, 0.2))]
    pauses = [d for d in decisions if not d.final]
    assert {d.line for d in pauses} == set(lines)  # every line pauses mid-sentence, long enough for the VAD to stop
    # The model ends the turn at such a pause (make it the default only once this fails: turn_check.py measures).
    assert any(d.complete for d in pauses), pauses
    assert all(d.cpu_ms > 0 for d in decisions)
