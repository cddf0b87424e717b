"""What a seed guarantees (docs/engine.md#seeds-what-is-reproducible), on the hf backend with the test model: the
same request run alone gives the same tokens every time, and sentence i of a long text the tokens of that sentence
spoken alone with seed + i. Not guaranteed, so not tested: the same tokens when other streams share the steps."""

from __future__ import annotations

from dataclasses import replace

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from tests.stubs import started

TEXT = "Hello there. How are you today? I hope the weather is kind to you."


async def _tokens(engine: OrpheusEngine, text: str, seed: int) -> list[int]:
    log: list[int] = []
    async for _ in engine.synthesize(text, seed=seed, max_tokens=70, token_log=log):
        pass
    return log


def _utterances(log: list[int], end: int) -> list[list[int]]:
    """The token log split after each end-of-speech id (the engine closes every utterance's ids with one)."""
    pieces, current = [], []
    for token in log:
        current.append(token)
        if token == end:
            pieces.append(current)
            current = []
    return pieces


async def test_a_seeded_request_alone_gives_the_same_tokens_every_time_and_another_seed_others(
    hf_config: EngineConfig,
) -> None:
    async with started(hf_config) as engine:
        first, again, other = [await _tokens(engine, "Hello there.", seed) for seed in (5, 5, 6)]
    assert len(first) > 28 and first == again
    assert other != first


async def test_sentence_i_of_a_long_text_gives_the_tokens_of_that_sentence_alone_with_seed_plus_i(
    hf_config: EngineConfig,
) -> None:
    async with started(replace(hf_config, sentence_max_chars=40)) as engine:
        sentences = engine.sentences(TEXT)
        whole = _utterances(await _tokens(engine, TEXT, seed=9), engine.spec.end_of_speech)
        alone = [await _tokens(engine, s, seed=9 + i) for i, s in enumerate(sentences)]
    assert len(sentences) >= 2 and whole == alone
