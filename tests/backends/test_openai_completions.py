"""The openai-completions backend against a real OpenAI-compatible server: `transformers serve` on 127.0.0.1 with
the test model.

The server runs in a subprocess on loopback only. Its streamed `<custom_token_N>` text is checked id for id
against the same generation run locally (same seed, same generation config), cancellation is checked by the
server's freed capacity, and retries by a refused port and by a late-starting TCP relay to the real server.
Small tests replay vLLM's stream format (token ids per chunk) and `transformers serve`'s (text per chunk) from an
in-process aiohttp server, directly or through a TCP relay that sends them byte by byte, late or cut
(tests/servers.py TcpRelay); the text → ids mapping is checked against every way of cutting its text. The backend
against a real vLLM OpenAI server runs in tests_vllm/ (the vLLM venv).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from orpheus_tts_plugin.backends import make_backend
from orpheus_tts_plugin.backends.openai_completions import CustomTokenText, OpenAICompletionsBackend
from orpheus_tts_plugin.backends.protocol import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.config import EngineConfig, SamplingParams
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.speech.prompt import prompt_ids
from orpheus_tts_plugin.tools.loopback import free_port
from orpheus_tts_plugin.weights import TOKENIZER, weight_sources
from tests.servers import TcpRelay, transformers_serve

SPEC = ENGLISH
BASE = SPEC.custom_token_base


@pytest.fixture(scope="module")
def model_dir(test_model_dir: Path) -> Path:
    """The tiny Orpheus-shaped checkpoint from the session's shared test model (tests/conftest.py)."""
    return test_model_dir / "orpheus"


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`transformers serve` with the test model on a free loopback port; its base URL."""
    with transformers_serve(model_dir, tmp_path_factory.mktemp("serve-log") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def request(
    tokenizer,
    rid: str,
    max_new: int,
    *,
    temperature: float = 1.0,
    seed: int | None = 1234,
    stop: tuple[int, ...] = (SPEC.end_of_speech,),
) -> GenerationRequest:
    prompt = prompt_ids(tokenizer, SPEC, "Hello there, how are you today?", "tara")
    sampling = SamplingParams(temperature=temperature, top_p=0.9, repetition_penalty=1.1, seed=seed)
    return GenerationRequest(rid, prompt, sampling, max_new, stop, True)


async def collect(stream, limit_s: float = 60.0) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return [ids async for ids in stream]

    return await asyncio.wait_for(run(), limit_s)


def served_ids(token_ids: list[int], stop: set[int], tokenizer) -> list[int]:
    """What a text-streaming server's output means to us (CustomTokenText), from the tokens: custom tokens kept,
    Llama 3 specials skipped (the server's detokeniser drops them, so they do not end a run), and each run of other
    tokens between custom tokens one pad if its text is not blank."""
    out: list[int] = []
    run: list[int] = []

    def end_run() -> None:
        if tokenizer.decode(run, skip_special_tokens=True).strip():
            out.append(SPEC.pad)
        run.clear()

    for t in token_ids:
        if t in stop:
            break
        if t >= BASE:
            end_run()
            out.append(t)
        elif t < SPEC.bos:
            run.append(t)
    end_run()
    return out


# ---- against the real server ----


async def test_streamed_ids_equal_the_same_generation_run_locally(server, model_dir, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    backend = OpenAICompletionsBackend(server, dialect="transformers", tokenizer=str(model_dir))
    await backend.start()
    assert backend.model == str(model_dir)  # discovered through GET /v1/models
    req = request(tokenizer, "exact", 24)
    stream = backend.generate(req)
    got = [i for ids in await collect(stream) for i in ids]
    await stream.aclose()

    body = json.loads(backend.request_body(req))
    config = GenerationConfig(**json.loads(body["generation_config"]))
    config.max_new_tokens, config.temperature, config.top_p = 24, body["temperature"], body["top_p"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inputs = tokenizer(body["prompt"], return_tensors="pt")
    torch.manual_seed(1234)
    out = model.generate(**inputs, generation_config=config)[0, inputs.input_ids.shape[1] :].tolist()

    assert got == served_ids(out, {SPEC.end_of_speech}, tokenizer) and got
    assert any(SPEC.first_audio_token <= i < SPEC.audio_token_end for i in got)  # the id mapping was exercised
    assert stream.finish_reason == (FinishReason.STOP if SPEC.end_of_speech in out else FinishReason.LENGTH)
    stats = backend.stats()
    assert stats["live_requests"] == 0 and stats["tokens"] == len(got) and stats["errors"] == 0
    await backend.close()


async def test_stop_id_ends_the_stream_and_is_not_delivered(server, tokenizer) -> None:
    backend = OpenAICompletionsBackend(server, dialect="transformers", tokenizer=tokenizer)
    await backend.start()
    greedy = [i for ids in await collect(backend.generate(request(tokenizer, "g", 8, temperature=0.0))) for i in ids]
    # An id the model emits greedily, used as an extra stop id; not pad: transformers also pads with it.
    stop_id = next(i for i in greedy if i >= BASE and i != SPEC.pad)
    stream = backend.generate(request(tokenizer, "s", 8, temperature=0.0, stop=(SPEC.end_of_speech, stop_id)))
    got = [i for ids in await collect(stream) for i in ids]
    # Each run of text that is not a custom token is one pad however the server cuts it into events (which
    # varies from run to run): the ids before the stop id are the greedy run's, exactly.
    assert got == greedy[: greedy.index(stop_id)]
    assert stream.finish_reason == FinishReason.STOP
    await backend.close()


FRAGMENTS = ["as served", "each split in two"]


def fragmented(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed text as the server's fragments cut it, or each cut in two (what a server that flushes its detokeniser
    at other moments sends): the ids must not vary with it (a run of text that is not a custom token is one pad)."""
    if pattern == "as served":
        return
    feed = CustomTokenText.feed

    def split(self: CustomTokenText, text: str) -> list[int]:
        return feed(self, text[: len(text) // 2]) + feed(self, text[len(text) // 2 :])

    monkeypatch.setattr(CustomTokenText, "feed", split)


@pytest.mark.parametrize("pattern", FRAGMENTS)
async def test_closing_the_stream_aborts_the_server_request(server, tokenizer, pattern, monkeypatch) -> None:
    fragmented(pattern, monkeypatch)
    backend = OpenAICompletionsBackend(server, dialect="transformers", tokenizer=tokenizer)
    await backend.start()
    long = backend.generate(request(tokenizer, "long", 4000, temperature=0.0))
    t0 = time.monotonic()
    chunks = [await asyncio.wait_for(long.__anext__(), 30) for _ in range(4)]
    per_token = (time.monotonic() - t0) / 4
    await long.aclose()
    assert long.finish_reason == FinishReason.ABORTED and len(chunks) == 4
    with pytest.raises(StopAsyncIteration):
        await long.__anext__()
    # transformers serve generates one request at a time: a short request finishes promptly only if the
    # 4000-token one was aborted when its connection closed.
    t1 = time.monotonic()
    short = backend.generate(request(tokenizer, "short", 3, temperature=0.0))
    # It ran to its 3-token limit: the server's finish reason says so (the ids count one pad a run of text between
    # custom tokens, so their number says nothing of the tokens: these 3 greedy ones are one run, one pad).
    assert await collect(short, 60) and short.finish_reason == FinishReason.LENGTH
    elapsed = time.monotonic() - t1
    assert elapsed < min(30.0, 3996 * per_token / 4), (elapsed, per_token)
    stats = backend.stats()
    assert stats["aborted"] == 1 and stats["live_requests"] == 0
    await backend.close()


async def test_http_error_is_a_backend_error_without_retries(server, tokenizer) -> None:
    backend = OpenAICompletionsBackend(
        server, dialect="transformers", tokenizer=tokenizer, extra_body={"not_a_field": 1}
    )
    await backend.start()
    stream = backend.generate(request(tokenizer, "bad", 4))
    with pytest.raises(BackendError, match="HTTP 422"):
        await asyncio.wait_for(stream.__anext__(), 30)
    assert stream.finish_reason == FinishReason.ERROR
    assert backend.stats()["retries"] == 0 and backend.stats()["errors"] == 1
    await backend.close()


async def test_retries_reach_a_server_that_comes_up_late(server, model_dir, tokenizer) -> None:
    """Connection refused at first; a TCP relay to the real server starts listening 0.3 s later. What comes
    through it is what the same seeded request gets from the server directly: the same ids, the same finish
    reason (compared with each other, not counted against the tokens: the ids of a text server count one pad a
    run of text, and must not depend on how the server's timing cuts or joins its events)."""
    target_port = int(server.rsplit(":", 1)[1])
    relay = TcpRelay(target_port)

    async def start_late() -> None:
        await asyncio.sleep(0.3)
        await relay.start()

    backend = OpenAICompletionsBackend(
        relay.url,
        model=str(model_dir),
        dialect="transformers",
        tokenizer=tokenizer,
        connect_retries=8,
        retry_backoff_s=0.05,
    )
    direct = OpenAICompletionsBackend(server, model=str(model_dir), dialect="transformers", tokenizer=tokenizer)
    try:
        await backend.start()
        await direct.start()
        starter = asyncio.create_task(start_late())
        stream = backend.generate(request(tokenizer, "late", 3))
        got = [i for ids in await collect(stream, 60) for i in ids]
        await starter
        assert backend.stats()["retries"] >= 1
        reference = direct.generate(request(tokenizer, "direct", 3))
        expected = [i for ids in await collect(reference, 60) for i in ids]
        assert got == expected and got
        assert stream.finish_reason == reference.finish_reason == FinishReason.LENGTH
    finally:
        await backend.close()
        await direct.close()
        await relay.close()


# ---- without the server ----


async def test_refused_connection_is_retried_then_fails() -> None:
    port = free_port()  # nothing listens here
    backend = OpenAICompletionsBackend(
        f"http://127.0.0.1:{port}", model="m", dialect="openai", connect_retries=2, retry_backoff_s=0.01
    )
    await backend.start()
    stream = backend.generate(GenerationRequest("x", (1, 2, 3), SamplingParams(), 5, (SPEC.end_of_speech,)))
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="after 3 attempt"):
        await asyncio.wait_for(stream.__anext__(), 10)
    assert time.monotonic() - t0 < 5
    assert stream.finish_reason == FinishReason.ERROR
    assert backend.stats() | {"url": None} == {
        "backend": "openai-completions",
        "url": None,
        "live_requests": 0,
        "requests": 1,
        "tokens": 0,
        "retries": 2,
        "pauses": 0,
        "resumes": 0,
        "paused_requests": 0,
        "aborted": 0,
        "errors": 1,
        "audio_constraint": "none",
    }
    await backend.close()


async def replay_server(obeys_xargs: bool):
    """An in-process server speaking vLLM's completions format: SSE token ids when streaming, JSON otherwise.

    Non-streaming requests (the backend's probe) get greedy-looking ids: inside the ranges `vllm_xargs` asks for if
    `obeys_xargs` (as a vLLM started with the processor does), else the audio ids an unconstrained model might emit.
    """
    from aiohttp import web

    bodies: list[dict] = []
    audio = [SPEC.audio_token(k, 9) for k in range(7)]

    async def completions(http_request: web.Request) -> web.StreamResponse:
        body = await http_request.json()
        bodies.append(body)
        if not body.get("stream"):
            xargs = body.get("vllm_xargs") or {}
            first = xargs.get("orpheus_first_audio_token", SPEC.first_audio_token) if obeys_xargs else 128_266
            ids = [first + k * 4096 + 9 for k in range(body["max_tokens"])]
            return web.json_response(
                {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}]}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http_request)
        chunks = [(audio[:3], None), ([], None), (audio[3:], None), ([SPEC.end_of_speech], "stop")]
        for ids, finish in chunks:
            choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 8}}\n\ndata: [DONE]\n\n')
        return resp

    runner, url = await completions_server(completions)
    return runner, url, bodies, audio


async def completions_server(handler: Any) -> tuple[Any, str]:
    """An aiohttp server on a free loopback port answering POST /v1/completions with `handler`; (runner, URL)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


AUDIO = [SPEC.audio_token(k, 100 + k) for k in range(7)]  # one frame


def name(token: int) -> str:
    return f"<custom_token_{token - BASE}>"


def sse(chunk: dict | str) -> bytes:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


def ids_event(token_ids: list[int], finish: str | None = None) -> bytes:
    """A chunk as vLLM streams it with `return_token_ids`."""
    choice = {"index": 0, "text": "", "token_ids": token_ids, "finish_reason": finish}
    return sse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]})


def text_event(text: str, finish: str | None = None) -> bytes:
    """A chunk as `transformers serve` streams it (pydantic's JSON, fields that are None left out)."""
    choice = {"index": 0, "text": text} | ({"finish_reason": finish} if finish else {})
    return sse({"id": "req-1", "choices": [choice], "created": 0, "model": "m", "object": "text_completion"})


# Known streams in each server's format: (SSE event, the ids it delivers) in order, and the finish reason. The
# text one cuts a token name across events, has a run of text over three events and an empty event.
STREAMS: dict[str, tuple[list[tuple[bytes, list[int]]], str]] = {
    "vllm": (
        [
            (ids_event(AUDIO[:3]), AUDIO[:3]),
            (ids_event([]), []),
            (ids_event(AUDIO[3:]), AUDIO[3:]),
            (ids_event([SPEC.end_of_speech], "stop"), []),  # the stop id: not delivered
            (sse('{"choices":[],"usage":{"completion_tokens":8}}'), []),
            (sse("[DONE]"), []),
        ],
        FinishReason.STOP,
    ),
    "transformers": (
        [
            (text_event(name(AUDIO[0])), AUDIO[:1]),
            (text_event(name(AUDIO[1]) + name(AUDIO[2])[:9]), AUDIO[1:2]),
            (text_event(name(AUDIO[2])[9:] + " hello"), [AUDIO[2], SPEC.pad]),
            (text_event(" world<|x|>"), []),
            (text_event(""), []),
            (text_event("\n" + "".join(map(name, AUDIO[3:]))), AUDIO[3:]),
            (text_event("", "length"), []),
        ],
        FinishReason.LENGTH,
    ),
}
FORMATS = list(STREAMS)


def stream_body(fmt: str) -> list[bytes]:
    return [event for event, _ in STREAMS[fmt][0]]


def stream_ids(fmt: str, events: int | None = None) -> list[int]:
    """The ids of the stream in format `fmt`, or of its first `events` events."""
    return [i for _, ids in STREAMS[fmt][0][:events] for i in ids]


HOLD = None  # in a response of sse_server: the server keeps the response open here until the client leaves


async def sse_server(*responses: list[bytes | None], end_at: int | None = None) -> tuple[Any, str, list[dict]]:
    """An in-process server answering the n-th POST /v1/completions with the SSE events of `responses[n]` (the last
    one for any after), each its own write (its own chunk of the chunked body); at HOLD it keeps the response open
    (an SSE comment every 10 ms) until the client leaves. With `end_at`, the body ends there (cleanly: its last
    chunk is sent) after that many bytes, in whatever event that is. (runner, URL, the request bodies)."""
    from aiohttp import web

    bodies: list[dict] = []

    async def completions(http_request: web.Request) -> web.StreamResponse:
        bodies.append(await http_request.json())
        events = responses[min(len(bodies), len(responses)) - 1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http_request)
        pos, end = 0, end_at
        for event in events:
            if event is HOLD:
                with contextlib.suppress(ConnectionError):
                    for _ in range(3000):  # 30 s at most
                        await asyncio.sleep(0.01)
                        await resp.write(b": generating\n\n")
                return resp
            part = event if end is None else event[: max(0, end - pos)]
            pos += len(event)
            if part:
                await resp.write(part)
        return resp

    runner, url = await completions_server(completions)
    return runner, url, bodies


def stream_backend(url: str, fmt: str) -> OpenAICompletionsBackend:
    """A backend reading the stream format `fmt`: token ids (dialect vllm, no probe) or text (dialect openai: the
    transformers dialect's text parsing, with prompt ids, so no tokenizer)."""
    if fmt == "vllm":
        return OpenAICompletionsBackend(url, model="m", dialect="vllm", constrain_audio=False)
    return OpenAICompletionsBackend(url, model="m", dialect="openai")


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def read_all(stream: Any, limit_s: float = 30.0) -> tuple[list[int], BackendError | None]:
    """Every id the stream delivers, in order, and the BackendError that ended it (None: it ended normally)."""
    got: list[int] = []

    async def run() -> BackendError | None:
        try:
            async for ids in stream:
                got.extend(ids)
        except BackendError as exc:
            return exc
        return None

    return got, await asyncio.wait_for(run(), limit_s)


@contextlib.asynccontextmanager
async def streamed(
    fmt: str, relay_options: dict[str, Any] | None, end_at: int | None = None
) -> AsyncIterator[tuple[OpenAICompletionsBackend, TcpRelay | None]]:
    """A started backend reading the known `fmt` stream from `sse_server` (its body ended at byte `end_at`), through a
    TcpRelay with `relay_options` if given; everything closed at the end."""
    runner, url, _ = await sse_server(stream_body(fmt), end_at=end_at)
    relay = TcpRelay(port_of(url), **relay_options) if relay_options else None
    backend = stream_backend(relay.url if relay else url, fmt)
    try:
        if relay:
            await relay.start()
        await backend.start()
        yield backend, relay
    finally:
        await backend.close()
        if relay:
            await relay.close()
        await runner.cleanup()


NETWORKS = {"direct": None, "byte by byte": {"chunk": 1}, "first byte late": {"first_byte_delay_s": 0.5}}


@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("fmt", FORMATS)
async def test_every_id_arrives_once_and_in_order_however_the_network_delivers_the_stream(
    fmt: str, network: str
) -> None:
    """A known stream, in vLLM's format (token ids) and in `transformers serve`'s (text), straight from the server,
    byte by byte through a relay (every SSE line and JSON cut wherever a read ends), and through a relay that holds
    back the server's first byte: every id once, in order, then the server's finish reason."""
    async with streamed(fmt, NETWORKS[network]) as (backend, _):
        req = GenerationRequest("n", (7, 8, 9), SamplingParams(seed=5), 100, (SPEC.end_of_speech,))
        stream = backend.generate(req)
        got, error = await read_all(stream)
        assert error is None and got == stream_ids(fmt)
        assert stream.finish_reason == STREAMS[fmt][1]
        stats = backend.stats()
        assert stats["tokens"] == len(got) and stats["errors"] == 0 and stats["live_requests"] == 0
        await stream.aclose()


# Where a stream is cut: in an event (the index of the event, where in it), and how. Where the relay cuts the
# connection, aiohttp sees the chunked body incomplete (ClientPayloadError); where the server ends its body there,
# readline returns the partial line (even a whole JSON, its line's end cut off). The relay cuts before a byte
# string found once in the stream, so a cut just before a line's end is the server's case only.
CUTS = {
    "in the middle of an event": (2, "middle"),
    "in the middle of the finish event": ("finish", "middle"),
    "after the finish event's JSON, before its line's end": ("finish", "before newline"),
}
RELAY_CUTS, SERVER_ENDS = "the relay cuts the connection", "the server ends the body"
CUT_CASES = [
    (where, how)
    for where, (_, at) in CUTS.items()
    for how in (RELAY_CUTS, SERVER_ENDS)
    if how == SERVER_ENDS or at != "before newline"
]


def cut_point(fmt: str, where: str) -> tuple[int, int, bytes]:
    """(index of the event cut, offset of the cut in the body, the rest of that event from the cut on)."""
    events = stream_body(fmt)
    index, at = CUTS[where]
    if index == "finish":
        index = next(k for k, (event, _) in enumerate(STREAMS[fmt][0]) if b'"finish_reason":"' in event)
    event = events[index]
    offset = len(event) // 2 if at == "middle" else len(event) - 2
    return index, len(b"".join(events[:index])) + offset, event[offset:]


@pytest.mark.parametrize(("where", "how"), CUT_CASES)
@pytest.mark.parametrize("fmt", FORMATS)
async def test_a_stream_cut_in_the_middle_of_an_event_ends_with_a_backend_error(fmt: str, where: str, how: str) -> None:
    """A stream cut inside an event, by the network (the relay, byte by byte, closes the connection there) or by
    the server (its body ends there): the ids of the events before the cut, then BackendError; never a stream that
    ends short as if it were complete, never an id of the cut event."""
    index, offset, rest = cut_point(fmt, where)
    relayed = how == RELAY_CUTS
    relay_options = {"chunk": 1, "cut_before": rest} if relayed else None
    async with streamed(fmt, relay_options, end_at=None if relayed else offset) as (backend, relay):
        stream = backend.generate(GenerationRequest("c", (7, 8, 9), SamplingParams(), 100, (SPEC.end_of_speech,)))
        got, error = await read_all(stream)
        assert isinstance(error, BackendError) and got == stream_ids(fmt, index), (error, got)
        assert stream.finish_reason == FinishReason.ERROR
        assert backend.stats()["errors"] == 1 and backend.stats()["live_requests"] == 0
        assert relay is None or relay.cuts == 1
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


async def test_vllm_token_id_stream_with_allowed_ids_where_the_server_lacks_the_processor() -> None:
    """vLLM's stream format (token_ids per choice, then [DONE]); the probe finds no processor: allowed ids."""
    runner, url, bodies, audio = await replay_server(obeys_xargs=False)
    try:
        backend = OpenAICompletionsBackend(url, model="orpheus", dialect="vllm", constrain_audio=True)
        await backend.start()
        assert backend.audio_constraint == "allowed_ids" and backend.stats()["audio_constraint"] == "allowed_ids"
        req = GenerationRequest("v", (7, 8, 9), SamplingParams(seed=5), 100, (SPEC.end_of_speech,))
        stream = backend.generate(req)
        assert await collect(stream, 10) == [audio[:3], audio[3:]]
        assert stream.finish_reason == FinishReason.STOP
        await stream.aclose()
        probe, body = bodies
        assert probe["stream"] is False and probe["vllm_xargs"]["orpheus_audio"] == 1
        assert body["prompt"] == [7, 8, 9] and body["return_token_ids"] is True and body["stream"] is True
        assert body["stop_token_ids"] == [SPEC.end_of_speech] and body["max_tokens"] == 100 and body["seed"] == 5
        assert body["allowed_token_ids"] == [*range(SPEC.first_audio_token, SPEC.audio_token_end), SPEC.end_of_speech]
        assert "vllm_xargs" not in body
        await backend.close()
    finally:
        await runner.cleanup()


async def test_vllm_position_constraint_goes_as_vllm_xargs_where_the_server_has_the_processor() -> None:
    runner, url, bodies, _ = await replay_server(obeys_xargs=True)
    try:
        # constrain_audio None: wherever it is cheap
        backend = OpenAICompletionsBackend(url, model="orpheus", dialect="vllm")
        await backend.start()
        assert backend.audio_constraint == "position"
        stream = backend.generate(GenerationRequest("p", (7, 8), SamplingParams(), 10, (SPEC.end_of_speech,)))
        await collect(stream, 10)
        body = bodies[-1]
        assert body["vllm_xargs"] == {
            "orpheus_audio": 1,
            "orpheus_first_audio_token": SPEC.first_audio_token,
            "orpheus_end_of_speech": SPEC.end_of_speech,
        }
        assert "allowed_token_ids" not in body
        unconstrained = GenerationRequest("u", (7,), SamplingParams(), 10, (SPEC.end_of_speech,), constrain_audio=False)
        assert "vllm_xargs" not in json.loads(backend.request_body(unconstrained))
        await backend.close()
    finally:
        await runner.cleanup()


async def test_without_the_processor_and_without_asking_nothing_constrains_the_request() -> None:
    runner, url, bodies, _ = await replay_server(obeys_xargs=False)
    try:
        backend = OpenAICompletionsBackend(url, model="orpheus", dialect="vllm")
        await backend.start()
        assert backend.audio_constraint == "none"  # no 200 kB allowed-ids list per request unless asked
        body = json.loads(backend.request_body(GenerationRequest("n", (7,), SamplingParams(), 10, (1,))))
        assert "allowed_token_ids" not in body and "vllm_xargs" not in body
        off = OpenAICompletionsBackend(url, model="orpheus", dialect="vllm", constrain_audio=False)
        await off.start()
        assert off.audio_constraint == "none" and len(bodies) == 1  # constrain_audio=False: no probe
        await backend.close()
        await off.close()
    finally:
        await runner.cleanup()


def test_each_dialect_sends_only_the_fields_its_server_knows() -> None:
    req = GenerationRequest(
        "d", (5, 6), SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1), 42, (SPEC.end_of_speech,)
    )
    trt = json.loads(OpenAICompletionsBackend("http://h:1/v1/", model="m", dialect="trtllm").request_body(req))
    assert trt == {
        "model": "m",
        "prompt": [5, 6],
        "max_tokens": 42,
        "stream": True,
        "temperature": 0.6,
        "top_p": 0.8,
        "repetition_penalty": 1.1,
        "stop_token_ids": [128258],
        "skip_special_tokens": False,
        "detokenize": False,
    }
    plain = json.loads(OpenAICompletionsBackend("http://h:1", model="m", dialect="openai").request_body(req))
    assert plain == {"model": "m", "prompt": [5, 6], "max_tokens": 42, "stream": True, "temperature": 0.6, "top_p": 0.8}
    vllm = json.loads(OpenAICompletionsBackend("http://h:1", model="m").request_body(req))
    assert "allowed_token_ids" not in vllm and vllm["return_token_ids"] is True  # not started: no processor known
    told = json.loads(OpenAICompletionsBackend("http://h:1", model="m", audio_processor=True).request_body(req))
    assert told["vllm_xargs"]["orpheus_first_audio_token"] == SPEC.first_audio_token
    trt = OpenAICompletionsBackend(
        "http://h:1", model="m", dialect="trtllm", audio_processor=True, constrain_audio=True
    )
    assert trt.audio_constraint == "none" and "vllm_xargs" not in json.loads(trt.request_body(req))
    assert OpenAICompletionsBackend("http://h:1/v1/").endpoint == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="tokenizer"):
        OpenAICompletionsBackend("http://h:1", dialect="transformers")
    with pytest.raises(ValueError, match="dialect"):
        OpenAICompletionsBackend("http://h:1", dialect="sglang-ish")


def test_the_backend_is_chosen_by_its_name_or_its_old_one() -> None:
    """`openai-completions` takes its URL from `completions_url`; "remote", its old name, from `model` if unset."""
    new = EngineConfig(backend="openai-completions", completions_url="http://h:1/v1", model="me/orpheus")
    old = EngineConfig(backend="remote", model="http://h:2", tokenizer="me/tok")
    old_with_url = EngineConfig(backend="remote", completions_url="http://h:3", model="me/orpheus")
    for config, url, tokenizer in ((new, "http://h:1", "me/orpheus"), (old, "http://h:2", "me/tok")):
        backend = make_backend(config, SPEC, "cpu")
        assert isinstance(backend, OpenAICompletionsBackend)
        assert (backend.url, backend.tokenizer) == (url, tokenizer)
    assert old_with_url.completions_server == "http://h:3" and EngineConfig().completions_server is None
    assert [s for s in weight_sources(new) if s[0] != "SNAC"] == [("the tokenizer", "me/orpheus", TOKENIZER)]
    with pytest.raises(ValueError, match="needs completions_url"):
        EngineConfig(backend="openai-completions")
    with pytest.raises(ValueError, match="set tokenizer"):
        EngineConfig(backend="remote", model="http://h:2")
    with pytest.raises(ValueError, match="completions_url is for backend"):
        EngineConfig(backend="hf", completions_url="http://h:1")


def test_custom_token_text_becomes_ids_even_when_split_across_chunks() -> None:
    """Custom tokens exactly, whatever chunk a name ends in; each run of other text between them one pad, out at
    its first non-blank character; a blank run nothing; a partial name left at the end text of the last run."""
    p = CustomTokenText(BASE, SPEC.pad)
    assert p.feed("<custom_tok") == []  # a token split across chunks waits
    assert p.feed("en_5><custom_token_7>") == [BASE + 5, BASE + 7]
    assert p.feed("<custom_token_1> hi<custom_token_2>") == [BASE + 1, SPEC.pad, BASE + 2]
    assert p.feed("  \n") == []  # whitespace between tokens is not an id
    assert p.feed(" h") == [SPEC.pad]  # a run's pad is out at its first non-blank character...
    assert p.feed("ello wor") == [] and p.feed("ld<notatoken>") == []  # ... and the run, spaces and all, is one
    assert p.feed("<custom_token_3><custom_token_x>") == [BASE + 3, SPEC.pad]
    assert p.feed("<custom_token_4><custom_token_12") == [BASE + 4] and p.flush() == [SPEC.pad]  # never completed
    q = CustomTokenText(BASE, SPEC.pad)
    assert q.feed("text<custom_tok") == [SPEC.pad] and q.flush() == []  # the tail was more text of the same run


# Pieces of streamed text: custom tokens, names cut anywhere, near misses, ordinary text and whitespace, the test
# model's text tokens (`<|unused_filler_N|>`, what its random weights mostly generate), a special token's name.
PIECES = (
    "<custom_token_5>", "<custom_token_4107>", "<custom_token_", "<custom_tok", "en_9>", "12", "<", ">", "x", " ",
    "\n", "hi there", "<|unused_filler_37033|>", "<|eot_id|>", "é", "<custom_token_x>",
)  # fmt: skip


def ids_of(fragments: list[str]) -> list[int]:
    """What CustomTokenText makes of a stream whose text comes in these fragments (events), flushed at its end."""
    p = CustomTokenText(BASE, SPEC.pad)
    return [i for fragment in fragments for i in p.feed(fragment)] + p.flush()


def ids_of_text(text: str) -> list[int]:
    """The ids CustomTokenText's docstring defines, written another way, from the whole text: each custom token its
    id, each piece of text between them one pad unless blank."""
    parts = re.split(r"<custom_token_(\d+)>", text)  # text, N, text, N, ..., text
    return [BASE + int(part) if i % 2 else SPEC.pad for i, part in enumerate(parts) if i % 2 or part.strip()]


def cut(text: str, positions: list[int]) -> list[str]:
    """`text` cut at these positions (sorted; a position twice gives an empty fragment, as servers send)."""
    bounds = [0, *positions, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_the_ids_of_streamed_text_do_not_depend_on_how_the_server_cuts_or_joins_it() -> None:
    """The same text cut into fragments anywhere (joined whole, character by character, in two at every position,
    at random positions, mid token name) gives the same ids: those of the whole text. Servers cut their text into
    events as their timing goes (`transformers serve` joins the texts of several tokens into one event when its
    writer falls behind), so ids that depended on the cuts would depend on the server's load."""
    rng = random.Random(48)
    # The test model's 3 text tokens of issue 48: 3 pads sent apart and 2 joined under load, before runs.
    fillers = "<|unused_filler_37033|><|unused_filler_85634|><|unused_filler_78433|>"
    texts = [
        fillers,
        "<custom_token_10><custom_token_4107> hello world<|x|><custom_token_8202>\n",
        "<<custom_token_5><custom_token_12<custom_token_6>  <custom_token_7>x<custom_tok",
        *("".join(rng.choices(PIECES, k=rng.randint(0, 12))) for _ in range(300)),
    ]
    assert ids_of_text(fillers) == [SPEC.pad]
    for text in texts:
        expected = ids_of_text(text)
        assert ids_of([text]) == expected, text
        assert ids_of(list(text)) == expected, text
        for i in range(len(text) + 1):
            assert ids_of(cut(text, [i])) == expected, (text, i)
        for _ in range(20):
            positions = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, len(text) + 1)))
            assert ids_of(cut(text, positions)) == expected, (text, positions)


async def pacing_server(period_s: float):
    """vLLM's stream format, one audio id every `period_s` in the frame position after `orpheus_audio_offset`, until
    `max_tokens`; records each streaming body and each request the client left before its end."""
    from aiohttp import web

    bodies: list[dict] = []
    left: list[str] = []

    async def completions(http_request: web.Request) -> web.StreamResponse:
        body = await http_request.json()
        if not body.get("stream"):  # the probe: a server with the processor
            ids = [k * 4096 + 9 for k in range(body["max_tokens"])]
            return web.json_response({"choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]})
        bodies.append(body)
        offset = body["vllm_xargs"].get("orpheus_audio_offset", 0)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http_request)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(period_s)
                last = i == body["max_tokens"] - 1
                choice = {
                    "token_ids": [SPEC.audio_token((offset + i) % 7, i)],
                    "finish_reason": "length" if last else None,
                }
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            left.append(body["prompt"][-1])
            raise
        return resp

    runner, url = await completions_server(completions)
    return runner, url, bodies, left


@pytest.mark.parametrize("period_s", [0.0, 0.02], ids=["fast", "paced"])
async def test_a_paused_stream_leaves_the_server_and_resumes_as_one_request(period_s: float) -> None:
    """pause(True) ends the request on the server (its row freed); pause(False): the next read sends prompt + every
    id delivered, the rest of the budget, the constraint at the next frame position; no id lost or repeated."""
    runner, url, bodies, left = await pacing_server(period_s)
    backend = OpenAICompletionsBackend(url, model="orpheus", dialect="vllm")
    try:
        await backend.start()
        assert backend.audio_constraint == "position"
        req = GenerationRequest("s", (7, 8, 9), SamplingParams(seed=5), 30, (SPEC.end_of_speech,))
        stream = backend.generate(req)
        got = [*await stream.__anext__(), *await stream.__anext__(), *await stream.__anext__()]
        stream.pause(True)
        deadline = time.monotonic() + 5
        while period_s and not left and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert left or not period_s, "the server never saw the request leave"  # fast: it may have sent all 30
        assert backend.stats()["paused_requests"] == 1
        stream.pause(False)
        async for ids in stream:
            got += ids
        assert stream.finish_reason == FinishReason.LENGTH and len(got) == 30
        assert [(i - SPEC.first_audio_token) // 4096 for i in got] == [k % 7 for k in range(30)]  # positions in turn
        first, second = bodies
        assert second["prompt"] == [7, 8, 9, *got[:3]] and second["max_tokens"] == 27
        assert second["vllm_xargs"]["orpheus_audio_offset"] == 3 and "orpheus_audio_offset" not in first["vllm_xargs"]
        assert second["seed"] != first["seed"] == 5
        stats = backend.stats()
        assert stats["requests"] == 1 and stats["pauses"] == stats["resumes"] == 1 and stats["paused_requests"] == 0
        await stream.aclose()
    finally:
        await backend.close()
        await runner.cleanup()


async def test_a_run_of_text_that_a_pause_cuts_goes_on_in_the_continuation_as_the_same_run() -> None:
    """A text server's stream paused in a run of text (its pad delivered): the continuation's prompt is the first
    prompt + the ids delivered (the run as its one pad), its budget the rest, and its text before its first custom
    token is the same run, no second pad: the ids are those of the unpaused stream's text."""
    first = [text_event(name(AUDIO[0])), text_event(" hel"), HOLD]
    rest = [text_event("lo"), text_event(" world"), text_event(name(AUDIO[1])), text_event("", "length")]
    runner, url, bodies = await sse_server(first, rest)
    backend = stream_backend(url, "transformers")
    try:
        await backend.start()
        stream = backend.generate(GenerationRequest("t", (7, 8, 9), SamplingParams(seed=5), 30, (SPEC.end_of_speech,)))
        got = [*await stream.__anext__(), *await stream.__anext__()]
        assert got == [AUDIO[0], SPEC.pad]
        stream.pause(True)
        stream.pause(False)
        more, error = await read_all(stream)
        # What the text `<a> hello world<b>` gives unpaused: one pad for " hello world", not one for each part.
        assert error is None and got + more == [AUDIO[0], SPEC.pad, AUDIO[1]]
        assert stream.finish_reason == FinishReason.LENGTH
        assert bodies[1]["prompt"] == [7, 8, 9, AUDIO[0], SPEC.pad] and bodies[1]["max_tokens"] == 28
        await stream.aclose()
    finally:
        await backend.close()
        await runner.cleanup()
