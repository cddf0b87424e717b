"""HFBackend's prefix store: a shared prompt prefix (a cloned voice's reference turn) prefilled once, its keys and
values copied into each later row; the tokens are those of the whole prompt prefilled, alone and in mixed batches."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from orpheus_tts_plugin.backends.protocol import GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME
from tests.backends.test_hf import collect, orpheus_dir, prompt, started  # noqa: F401 - orpheus_dir: a fixture

SPEC = ENGLISH
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.1)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=7)


def reference_turn(frames: int, seed: int) -> tuple[int, ...]:
    """A reference turn shaped as `prompt.reference_prompt` builds it: a transcript's turn, audio ids, their end."""
    codes = [
        SPEC.audio_token(k % TOKENS_PER_FRAME, (seed * 977 + 31 * k) % CODEBOOK_SIZE)
        for k in range(frames * TOKENS_PER_FRAME)
    ]
    return (*prompt(6, seed), *codes, SPEC.end_of_speech, SPEC.end_of_ai)


def cloned(prefix: tuple[int, ...], text_seed: int, sampling: SamplingParams, tag: str = "") -> GenerationRequest:
    return GenerationRequest(
        request_id=f"c{text_seed}{tag}",
        prompt_ids=(*prefix, *prompt(5 + text_seed, text_seed)),
        sampling=sampling,
        max_new_tokens=35,
        stop_ids=(SPEC.end_of_speech,),
        prefix_len=len(prefix),
    )


def stock(text_seed: int, sampling: SamplingParams) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"s{text_seed}",
        prompt_ids=prompt(4 + text_seed, 50 + text_seed),
        sampling=sampling,
        max_new_tokens=35,
        stop_ids=(SPEC.end_of_speech,),
    )


async def run(backend, requests: list[GenerationRequest]) -> list[list[int]]:
    results = await asyncio.gather(*(collect(backend.generate(r)) for r in requests))
    return [ids for ids, _ in results]


@pytest.mark.parametrize("variant", ["fast", "static"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_reused_prefix_gives_the_tokens_of_the_whole_prompt_prefilled_alone_and_in_mixed_batches(
    orpheus_dir: str,  # noqa: F811
    variant: str,
    sampling: SamplingParams,
) -> None:
    a, b = reference_turn(20, 1), reference_turn(12, 2)
    alone = [cloned(a, 1, sampling), cloned(a, 2, sampling), cloned(b, 3, sampling)]
    mixed = [stock(1, sampling), cloned(a, 4, sampling, "m"), stock(2, sampling), cloned(b, 5, sampling, "m")]
    out = {}
    for reuse in (False, True):
        async with started(orpheus_dir, variant, max_seq_len=512, prefix_reuse=reuse) as backend:
            first = [(await run(backend, [r]))[0] for r in alone]  # each alone: a's miss, then a's hit, b's miss
            batch = await run(backend, mixed)  # both prefixes hit, among rows without one
            out[reuse] = (first, batch, backend.stats())
    assert out[True][:2] == out[False][:2]
    assert all(len(ids) > 7 for ids in out[True][0] + out[True][1])
    assert len({tuple(ids) for ids in out[True][0]}) == 3  # different texts, different tokens
    on, off = out[True][2], out[False][2]
    assert (on["prefix_misses"], on["prefix_hits"], on["cached_prefixes"]) == (2, 3, 2)
    assert "prefix_hits" not in off and off["cached_prefixes"] == 0


async def test_the_store_keeps_the_most_recent_prefixes_and_forgets_on_request(orpheus_dir: str) -> None:  # noqa: F811
    prefixes = [reference_turn(4, seed) for seed in range(4)]
    async with started(orpheus_dir, max_seq_len=256, max_prefixes=2) as backend:
        for p in (*prefixes[:3], prefixes[1]):  # a, b, c (a dropped), then b again: a hit
            await run(backend, [cloned(p, 1, GREEDY)])
        stats = backend.stats()
        assert (stats["prefix_misses"], stats["prefix_hits"], stats["cached_prefixes"]) == (3, 1, 2)
        backend.forget_prefix(prefixes[1])
        assert backend.stats()["cached_prefixes"] == 1
        await run(backend, [cloned(prefixes[1], 2, GREEDY)])
        assert backend.stats()["prefix_misses"] == 4


async def test_a_prefix_as_long_as_the_prompt_less_its_last_id_is_reused_too(orpheus_dir: str) -> None:  # noqa: F811
    """The last prompt id is fed at the first step, never prefilled: a prefix of all the others still reuses."""
    ids = prompt(9, 3)
    req = GenerationRequest("whole", ids, GREEDY, 20, (SPEC.end_of_speech,), prefix_len=len(ids) - 1)
    outs = []
    for reuse in (False, True):
        async with started(orpheus_dir, prefix_reuse=reuse) as backend:
            outs.append([(await run(backend, [r]))[0] for r in (req, replace(req, request_id="again"))])
    assert outs[0] == outs[1] and outs[1][0] == outs[1][1]
