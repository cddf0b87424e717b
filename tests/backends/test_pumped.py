"""PumpedStream's pause and resume (the vLLM and TensorRT-LLM streams' base) against a small fake engine.

The fake takes a request and hands back an async iterator of its per-step outputs (`.finished`, `.outputs[0]` with
`token_ids` and `finish_reason`), as both engines do; each test drives the steps by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from orpheus_tts_plugin.backends.protocol import BackendError, FinishReason, GenerationRequest, PausableStream
from orpheus_tts_plugin.backends.pumped import PumpedStream, RequestCounts, continuation_seed
from orpheus_tts_plugin.config import SEED_LIMIT, SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
EOS = SPEC.end_of_speech
PROMPT = (SPEC.start_of_human, SPEC.bos, 11, 22, *SPEC.prompt_suffix())


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class Output:
    outputs: list[Completion]
    finished: bool


@dataclass
class Submitted:
    """One request as the fake engine holds it: what was sent, and the steps still to hand out."""

    req: GenerationRequest
    audio_offset: int
    steps: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)

    def step(self, ids: list[int], finish: str | None = None) -> None:
        self.steps.put_nowait(Output([Completion(ids, finish)], finish is not None))

    async def outputs(self) -> AsyncIterator[Output]:
        while True:
            out = await self.steps.get()
            yield out
            if out.finished:
                return


class FakeEngine:
    """Takes requests, records aborts; `refuse` makes the next submission raise."""

    def __init__(self) -> None:
        self.submitted: list[Submitted] = []
        self.aborted: list[str] = []
        self.refuse = False

    def submit(self, req: GenerationRequest, audio_offset: int) -> AsyncIterator[Output]:
        if self.refuse:
            raise RuntimeError("engine is full")
        self.submitted.append(Submitted(req, audio_offset))
        return self.submitted[-1].outputs()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeStream(PumpedStream):
    name = "fake"
    finish_reasons = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

    def __init__(self, engine: FakeEngine, req: GenerationRequest, counts: RequestCounts) -> None:
        self.engine = engine
        counts.started()
        super().__init__(req, engine.submit(req, 0), (EOS,), counts)

    def _new_ids(self, completion: Any) -> list[int]:
        return completion.token_ids

    def _abort(self) -> Any:
        return self.engine.abort(self.attempt.request_id)

    def _resubmit(self, req: GenerationRequest, audio_offset: int) -> Any:
        return self.engine.submit(req, audio_offset)


def request(max_new: int = 100, seed: int | None = 7) -> GenerationRequest:
    sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=seed)
    return GenerationRequest("r", PROMPT, sampling, max_new, (EOS,))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def counts() -> RequestCounts:
    return RequestCounts(pausable=True)


async def rest(stream: FakeStream) -> list[list[int]]:
    return await asyncio.wait_for(_collect(stream), 2.0)


async def _collect(stream: FakeStream) -> list[list[int]]:
    return [ids async for ids in stream]


async def test_a_paused_stream_aborts_its_request_and_resumes_with_everything_delivered_in_the_prompt(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    assert isinstance(stream, PausableStream)
    first = engine.submitted[0]
    first.step([1, 2, 3])
    assert await stream.__anext__() == [1, 2, 3]
    first.step([4])
    await settle()  # delivered to the mailbox, not yet taken
    stream.pause(True)
    await settle()
    assert engine.aborted == ["r"] and counts.stats("fake")["paused_requests"] == 1
    first.step([99])  # the aborted request's last step: nobody reads it
    stream.pause(False)
    await settle()
    cont = engine.submitted[1]
    req = request()
    assert cont.req == replace(
        req,
        request_id="r~1",
        prompt_ids=(*PROMPT, 1, 2, 3, 4),
        max_new_tokens=96,
        sampling=replace(req.sampling, seed=continuation_seed(7, 1)),
        priority=True,
    )
    assert cont.audio_offset == 4 == stream.generated and stream.attempt is cont.req
    cont.step([5, 6])
    cont.step([7, EOS], "stop")
    assert await rest(stream) == [[4], [5, 6], [7]]  # none lost, none twice, the stop id dropped
    assert stream.finish_reason == FinishReason.STOP and engine.aborted == ["r"]
    stats = counts.stats("fake")
    assert (stats["requests"], stats["live_requests"], stats["tokens"]) == (1, 0, 7)  # one request, counted once
    assert (stats["pauses"], stats["resumes"], stats["paused_requests"]) == (1, 1, 0)


async def test_a_second_pause_continues_from_the_ids_of_both_attempts(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    engine.submitted[0].step([1, 2])
    for ids in ([3], [4, 5]):
        await settle()
        stream.pause(True)
        stream.pause(False)
        await settle()
        engine.submitted[-1].step(ids)
    await settle()
    stream.pause(True)
    stream.pause(False)
    await settle()
    last = engine.submitted[-1]
    assert [s.req.request_id for s in engine.submitted] == ["r", "r~1", "r~2", "r~3"]
    assert engine.aborted == ["r", "r~1", "r~2"]
    assert last.req.prompt_ids == (*PROMPT, 1, 2, 3, 4, 5) and last.audio_offset == 5
    assert last.req.max_new_tokens == 95 and last.req.sampling.seed == continuation_seed(7, 3)
    await stream.aclose()


async def test_closing_a_paused_stream_resubmits_nothing_and_aborts_once(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    engine.submitted[0].step([1])
    await settle()
    stream.pause(True)
    await settle()
    await stream.aclose()
    await settle()
    assert stream.finish_reason == FinishReason.ABORTED
    assert len(engine.submitted) == 1 and engine.aborted == ["r"]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    stats = counts.stats("fake")
    assert (stats["live_requests"], stats["paused_requests"], stats["aborted"], stats["resumes"]) == (0, 0, 1, 0)
    stream.pause(False)  # after the end: nothing
    await settle()
    assert len(engine.submitted) == 1


async def test_a_pause_that_ends_because_the_stream_closes_resubmits_nothing(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    await settle()
    stream.pause(True)
    stream.pause(False)  # the engine's `finally` resumes, then closes
    await stream.aclose()
    await settle()
    assert len(engine.submitted) == 1 and engine.aborted == ["r"]
    assert counts.stats("fake")["paused_requests"] == 0 and counts.live == 0


async def test_pausing_a_finished_stream_does_nothing(engine: FakeEngine, counts: RequestCounts) -> None:
    stream = FakeStream(engine, request(), counts)
    engine.submitted[0].step([1, EOS], "stop")
    assert await rest(stream) == [[1]]
    stream.pause(True)
    stream.pause(False)
    await settle()
    assert len(engine.submitted) == 1 and engine.aborted == []
    assert counts.stats("fake")["pauses"] == 0


async def test_pausing_or_resuming_twice_acts_once(engine: FakeEngine, counts: RequestCounts) -> None:
    stream = FakeStream(engine, request(), counts)
    engine.submitted[0].step([1])
    await settle()
    stream.pause(True)
    stream.pause(True)
    await settle()
    stream.pause(False)
    stream.pause(False)
    await settle()
    assert engine.aborted == ["r"] and [s.req.request_id for s in engine.submitted] == ["r", "r~1"]
    stats = counts.stats("fake")
    assert (stats["pauses"], stats["resumes"], stats["paused_requests"]) == (1, 1, 0)
    await stream.aclose()
    assert engine.aborted == ["r", "r~1"]  # the continuation is the request now


async def test_paused_again_before_the_resubmission_nothing_is_sent_until_the_next_resume(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    await settle()
    stream.pause(True)
    stream.pause(False)
    stream.pause(True)  # within the same turn of the loop
    await settle()
    assert len(engine.submitted) == 1 and engine.aborted == ["r"]
    assert counts.stats("fake")["paused_requests"] == 1
    stream.pause(False)
    await settle()
    assert [s.req.request_id for s in engine.submitted] == ["r", "r~1"]
    await stream.aclose()


async def test_a_budget_spent_when_the_pause_came_ends_the_stream_as_length(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(max_new=3), counts)
    engine.submitted[0].step([1, 2, 3])  # all of it, but the finished output has not come yet
    await settle()
    stream.pause(True)
    stream.pause(False)
    assert await rest(stream) == [[1, 2, 3]]
    assert stream.finish_reason == FinishReason.LENGTH and len(engine.submitted) == 1


async def test_a_continuation_the_engine_refuses_fails_the_stream_with_a_backend_error(
    engine: FakeEngine, counts: RequestCounts
) -> None:
    stream = FakeStream(engine, request(), counts)
    engine.submitted[0].step([1])
    await settle()
    stream.pause(True)
    engine.refuse = True
    stream.pause(False)
    assert await stream.__anext__() == [1]
    with pytest.raises(BackendError, match="could not resume r: engine is full"):
        await asyncio.wait_for(stream.__anext__(), 2.0)
    assert stream.finish_reason == FinishReason.ERROR
    assert (counts.live, counts.counts["errors"], counts.paused) == (0, 1, 0)


def test_a_continuation_seed_is_derived_in_range_and_unlike_the_next_sentence_s() -> None:
    assert continuation_seed(None, 1) is None  # unseeded stays unseeded
    seeds = [continuation_seed(s, n) for s in (0, 7, SEED_LIMIT - 1) for n in (1, 2, 3)]
    assert all(0 <= s < SEED_LIMIT for s in seeds) and len(set(seeds)) == len(seeds)
    assert continuation_seed(7, 1) == continuation_seed(7, 1) not in (7, 8)  # the engine seeds sentence i with seed + i
