"""LoRA adapters on a real vLLM (its CPU build): requests of two adapters and of the base model share one batch.

Exactness: an adapter request makes the tokens of its merged checkpoint (W + lora_alpha / r · B @ A) served alone by
vLLM, greedy and seeded, while base rows and the other adapter's rows run beside it; a base row makes the base model's
tokens. On the CPU build (fp32, vLLM's PunicaWrapperCPU: x @ W + scale · (x @ A) @ B) the logits are not bitwise those
of the merged weights, but the tokens are (measured: all 140 of every row); a test fails on the first token that
differs. Base rows need the backend's spare LoRA slot (VllmBackend.lora_slots): without it they differed at the first
token. Engines run one at a time: the LoRA engine, then the base model's and each merged checkpoint's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import invalid_positions

from orpheus_tts_plugin.backends.protocol import FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.vllm import VllmBackend, VllmStream
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.tools.testmodel import write_lora_adapter
from tests.lora import merge_lora_adapter

SPEC = ENGLISH
PROMPT = (SPEC.start_of_human, SPEC.bos, 300, 301, 302, 303, 304, 305, *SPEC.prompt_suffix())
GUARD_S = 180  # a hang guard, never a speed expectation
N = 140  # 20 frames
ADAPTERS = ("a", "b")
ROWS = {  # the mixed batch: (adapter, sampling) per row
    "base-greedy": (None, "greedy"),
    "a-greedy": ("a", "greedy"),
    "b-greedy": ("b", "greedy"),
    "base-seeded": (None, "seeded"),
    "a-seeded": ("a", "seeded"),
    "b-seeded": ("b", "seeded"),
}


def request(rid: str, adapter: str | None, sampling: str, max_new: int = N) -> GenerationRequest:
    temperature = 0.0 if sampling == "greedy" else 0.6
    params = SamplingParams(temperature=temperature, top_p=0.8, repetition_penalty=1.1, seed=7)
    return GenerationRequest(rid, PROMPT, params, max_new, (SPEC.end_of_speech,), True, adapter=adapter)


async def run(backend: VllmBackend, req: GenerationRequest) -> list[int]:
    stream = backend.generate(req)

    async def collect() -> list[int]:
        return [i async for ids in stream for i in ids]

    ids = await asyncio.wait_for(collect(), GUARD_S)
    assert stream.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    return ids


async def paused_and_resumed(backend: VllmBackend, req: GenerationRequest) -> list[int]:
    """All ids of `req`, paused once mid-frame (its vLLM request aborted) and resumed as a continuation."""
    stream: VllmStream = backend.generate(req)
    ids: list[int] = []
    while stream.generated < 10 or stream.generated % 7 == 0:
        ids += await asyncio.wait_for(stream.__anext__(), GUARD_S)
    stream.pause(True)
    await asyncio.sleep(0.2)
    stream.pause(False)
    ids += [i async for new in stream for i in new]
    assert stream.attempt.request_id == f"{req.request_id}~1" and stream.attempt.adapter == req.adapter
    return ids


@pytest.fixture(scope="module")
def models(test_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The test model, adapters a (r 8, alpha 16) and b (r 16, alpha 16), and each merged into the model."""
    out = tmp_path_factory.mktemp("lora")
    base = test_model_dir / "orpheus"
    a = write_lora_adapter(base, out / "a", rank=8, alpha=16, seed=1)
    b = write_lora_adapter(base, out / "b", rank=16, alpha=16, seed=2)
    merged = {name: merge_lora_adapter(base, path, out / f"merged-{name}") for name, path in (("a", a), ("b", b))}
    return SimpleNamespace(base=base, adapters={"a": a, "b": b}, merged=merged)


@pytest.fixture(scope="module")
async def lora_run(models: SimpleNamespace) -> SimpleNamespace:
    """The LoRA engine's results: the mixed batch, and a paused greedy adapter request; then vLLM is shut down."""
    backend = VllmBackend(str(models.base), adapters=[(n, str(p)) for n, p in models.adapters.items()])
    await backend.start()
    try:
        args = backend.engine_args()
        ids = await asyncio.gather(*(run(backend, request(rid, *row)) for rid, row in ROWS.items()))
        paused = await paused_and_resumed(backend, request("a-paused", "a", "greedy"))
        loras = {name: (a.int_id, a.rank) for name, a in backend.loras.items()}
    finally:
        await backend.close()
    return SimpleNamespace(args=args, ids=dict(zip(ROWS, ids)), paused=paused, loras=loras)


@pytest.fixture(scope="module")
async def merged_run(models: SimpleNamespace, lora_run: SimpleNamespace) -> dict[str, list[int]]:
    """The base model and each merged checkpoint served alone (after the LoRA engine has shut down), by row name."""
    out: dict[str, list[int]] = {}
    for name in ("base", *ADAPTERS):
        backend = VllmBackend(str(models.base if name == "base" else models.merged[name]))
        await backend.start()
        try:
            rows = [f"{name}-greedy", f"{name}-seeded"]
            ids = await asyncio.gather(*(run(backend, request(rid, None, rid.split("-")[1])) for rid in rows))
        finally:
            await backend.close()
        out.update(zip(rows, ids))
    return out


def first_difference(x: list[int], y: list[int]) -> int | None:
    """The first index where x and y differ (a length counts), None if equal."""
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))


def test_the_cpu_build_runs_lora_sized_to_the_adapters(lora_run: SimpleNamespace) -> None:
    a = lora_run.args
    assert (a.enable_lora, a.max_loras, a.max_lora_rank) == (True, 3, 16)  # 2 adapters and the spare slot
    assert lora_run.loras == {"a": (1, 8), "b": (2, 16)}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_row_of_a_mixed_batch_makes_the_tokens_of_its_merged_checkpoint_or_the_base_model(
    lora_run: SimpleNamespace, merged_run: dict[str, list[int]], row: str
) -> None:
    ids = lora_run.ids[row]
    assert len(ids) >= 28  # at least 4 frames, or the comparison says little
    assert first_difference(ids, merged_run[row]) is None


def test_the_adapters_change_the_tokens(lora_run: SimpleNamespace) -> None:
    ids = lora_run.ids
    pairs = [(x, y, s) for s in ("greedy", "seeded") for x, y in (("base", "a"), ("base", "b"), ("a", "b"))]
    diffs = {f"{x}/{y}-{s}": first_difference(ids[f"{x}-{s}"], ids[f"{y}-{s}"]) for x, y, s in pairs}
    assert None not in diffs.values(), diffs


def test_every_row_keeps_the_audio_constraint(lora_run: SimpleNamespace) -> None:
    assert {row: invalid_positions(ids) for row, ids in lora_run.ids.items()} == dict.fromkeys(ROWS, 0)


def test_a_paused_adapter_request_resumes_with_its_adapter(lora_run: SimpleNamespace) -> None:
    assert first_difference(lora_run.paused, lora_run.ids["a-greedy"]) is None


async def test_an_adapter_folder_that_is_not_a_lora_is_refused_before_vllm_loads(tmp_path: Path, models) -> None:
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    backend = VllmBackend(str(models.base), adapters=[("x", str(tmp_path))])
    with pytest.raises(ValueError, match="is not a LoRA \\(peft_type 'IA3'"):
        await backend.start()
    assert backend._engine is None
