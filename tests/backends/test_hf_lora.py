"""HFBackend's LoRA adapters: in one mixed batch (base rows, adapter x's, adapter y's), each adapter row's tokens are
those of the same request on the model with that adapter merged into its weights, each base row's those of the base
model; greedy and seeded, eager and static steps, with the prefix store; through the engine's public API too."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.backends.hf_lora import read_adapter
from orpheus_tts_plugin.backends.protocol import BackendError, GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.tools.testmodel import make_test_model, write_lora_adapter
from tests.backends.test_hf import collect, prompt, started
from tests.backends.test_hf_prefix import reference_turn
from tests.lora import merge_lora_adapter

SPEC = ENGLISH
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.1)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=7)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test model, adapters x and y of it, and the model with each merged in."""
    out = tmp_path_factory.mktemp("lora")
    make_test_model(out, snac="tiny", seed=0)
    dirs = {"base": out / "orpheus", "snac": out / "snac"}
    for name, seed in (("x", 1), ("y", 2)):
        dirs[name] = out / f"adapter-{name}"
        write_lora_adapter(dirs["base"], dirs[name], seed=seed)
        dirs[f"merged-{name}"] = merge_lora_adapter(dirs["base"], dirs[name], out / f"merged-{name}")
    return dirs


def req(rid: str, ids: tuple[int, ...], sampling: SamplingParams, adapter: str | None = None, prefix: int = 0):
    return GenerationRequest(
        rid, ids, sampling, 35, (SPEC.end_of_speech,), constrain_audio=True, prefix_len=prefix, adapter=adapter
    )


async def run(backend, requests: list[GenerationRequest]) -> list[list[int]]:
    """Tokens of `requests`, all admitted before the first step: one mixed batch."""
    results = await asyncio.gather(*(collect(backend.generate(r)) for r in requests))
    return [ids for ids, _ in results]


def adapters(models: dict[str, Path]) -> dict[str, str]:
    return {"x": str(models["x"]), "y": str(models["y"])}


@pytest.mark.parametrize("variant", ["fast", "static"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_adapter_rows_in_a_mixed_batch_equal_the_merged_model_and_base_rows_the_base_model(
    models: dict[str, Path], variant: str, sampling: SamplingParams
) -> None:
    who = ["base", "x", "y", "x", "base", "y"]  # request i: prompt i, spoken by who[i]
    mixed = [req(f"m{i}", prompt(4 + 3 * i, i), sampling, None if w == "base" else w) for i, w in enumerate(who)]
    async with started(str(models["base"]), variant, max_batch_size=8, adapters=adapters(models)) as backend:
        batch = await run(backend, mixed)
        assert backend.stats()["adapters"] == ["x", "y"]
    alone: list[list[int] | None] = [None] * len(who)
    for model in ("base", "x", "y"):
        path = models["base" if model == "base" else f"merged-{model}"]
        async with started(str(path), variant, max_batch_size=8) as backend:
            for i, w in enumerate(who):
                if w == model:
                    alone[i] = (await run(backend, [replace(mixed[i], adapter=None)]))[0]
            if model == "base":  # the adapters change the tokens: x's and y's prompts, spoken by the base model
                base_of = {i: (await run(backend, [replace(mixed[i], adapter=None)]))[0] for i in (1, 2)}
    assert batch == alone
    assert all(len(ids) > 7 for ids in batch)
    assert base_of[1] != batch[1] and base_of[2] != batch[2]


@pytest.mark.parametrize("variant", ["fast", "static"])
async def test_the_prefix_store_keeps_a_prefix_per_adapter(models: dict[str, Path], variant: str) -> None:
    """A cloned voice's reference turn, spoken by the base model and by adapter x: two stored prefixes, each row's
    tokens those of the matching model without the store."""
    turn = reference_turn(12, 1)
    ids = [(*turn, *prompt(5 + i, i)) for i in range(3)]
    rows = [req("b0", ids[0], GREEDY, None, len(turn)), req("x1", ids[1], GREEDY, "x", len(turn))]
    later = [req("x2", ids[2], GREEDY, "x", len(turn)), req("b2", ids[2], GREEDY, None, len(turn))]
    async with started(str(models["base"]), variant, max_seq_len=256, adapters=adapters(models)) as backend:
        first = [(await run(backend, [r]))[0] for r in rows]
        second = await run(backend, later)
        stats = backend.stats()
    assert (stats["prefix_misses"], stats["prefix_hits"], stats["cached_prefixes"]) == (2, 2, 2)
    expected = {}
    for model in ("base", "merged-x"):
        async with started(str(models[model]), variant, max_seq_len=256, prefix_reuse=False) as backend:
            expected[model] = [(await run(backend, [replace(r, adapter=None)]))[0] for r in (*rows, *later)]
    assert first[0] == expected["base"][0] and first[1] == expected["merged-x"][1]
    assert second == [expected["merged-x"][2], expected["base"][3]]
    assert second[0] != second[1]


async def test_an_unknown_adapter_fails_its_request_only(models: dict[str, Path]) -> None:
    async with started(str(models["base"]), adapters={"x": str(models["x"])}) as backend:
        bad = backend.generate(req("bad", prompt(5, 1), GREEDY, "nope"))
        with pytest.raises(BackendError, match="unknown adapter 'nope'; this backend's adapters: x"):
            await collect(bad)
        assert len((await run(backend, [req("ok", prompt(5, 1), GREEDY, "x")]))[0]) > 7
    async with started(str(models["base"])) as backend:
        with pytest.raises(BackendError, match="no adapters"):
            await collect(backend.generate(req("bad", prompt(5, 1), GREEDY, "x")))


def test_unsupported_peft_options_and_targets_are_refused_in_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    def variant(name: str, **changes: object) -> str:
        out = tmp_path / name
        shutil.copytree(models["x"], out)
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(out)

    with pytest.raises(ValueError, match=r"unsupported PEFT option\(s\) use_dora=True"):
        read_adapter("d", variant("dora", use_dora=True))
    with pytest.raises(ValueError, match="modules_to_save"):
        read_adapter("m", variant("save", modules_to_save=["lm_head"]))
    head = tmp_path / "head"
    write_lora_adapter(models["base"], head)
    weights = load_file(str(head / "adapter_model.safetensors"))
    weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    weights["base_model.model.lm_head.lora_B.weight"] = torch.zeros(10, 8)
    from safetensors.torch import save_file

    save_file(weights, str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="LoRA on 'lm_head' is not supported"):
        read_adapter("h", str(head))
    rs = read_adapter("rs", variant("rs", use_rslora=True))
    plain = read_adapter("plain", str(models["x"]))
    module = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(rs.weights[module][1], plain.weights[module][1] * 8**0.5)  # alpha/sqrt(r), alpha/r


async def test_the_engine_speaks_an_adapter_as_the_merged_model_does(models: dict[str, Path]) -> None:
    def config(model: str, **kw: object) -> EngineConfig:
        return EngineConfig(
            model=str(models[model]), backend="hf", snac=str(models["snac"]), device="cpu", max_seq_len=512, **kw
        )

    async def tokens(engine: OrpheusEngine, text: str, **kw: object) -> list[int]:
        log: list[int] = []
        async for _ in engine.synthesize(text, token_log=log, max_tokens=49, **kw):
            pass
        return log

    texts = ("Hi there. How are you?", "Good morning to you.")
    engine = OrpheusEngine(config("base", adapters=adapters(models), adapter_voices={"maya": "y"}))
    await engine.start()
    try:
        mixed = await asyncio.gather(
            tokens(engine, texts[0], voice="tara", adapter="x", seed=3),
            tokens(engine, texts[1], voice="tara", seed=4),
            tokens(engine, texts[1], voice="tara", adapter="y", seed=5, temperature=0.0),
            tokens(engine, texts[0], voice="maya", seed=6),  # a fine-tuned voice: adapter y, its name in the prompt
        )
        maya = await tokens(engine, texts[0], voice="maya", adapter="y", seed=6)
    finally:
        await engine.aclose()
    expected = []
    for model, text, kw in (
        ("merged-x", texts[0], {"seed": 3}),
        ("base", texts[1], {"seed": 4}),
        ("merged-y", texts[1], {"seed": 5, "temperature": 0.0}),
    ):
        merged = OrpheusEngine(config(model))
        await merged.start()
        try:
            expected.append(await tokens(merged, text, voice="tara", **kw))
        finally:
            await merged.aclose()
    assert mixed[:3] == expected
    assert mixed[3] == maya
    assert all(len(t) > 14 for t in mixed)
