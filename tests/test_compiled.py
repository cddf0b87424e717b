"""The decoder under torch.compile, alone and inside an engine: the same audio as the eager one, every bucket compiled
at warm-up, decoders made later reusing the compiled code.

One module, so that its compilations share a process: with a cold inductor cache (a clean CI host) the first test
compiles every bucket and the next two reuse it (2.4 and 0.3 s), where the engine's test in a module of its own
compiled every bucket again (74–122 s in CI runs).

One stream (`max_streams=1`: buckets of 1 row, 4 chunk lengths): dynamo compiles the first bucket, then once more
with the chunk length dynamic, and every later bucket reuses that. With two streams (the engine's geometry at
`max_streams=2`: a 2-row bucket too) it compiled a third time, with the rows dynamic as well: 254 s on an AVX2-only
AMD EPYC against two compilations' worth here. The two-stream run proves the same for a batched bucket; it stays
runnable: `pytest -m slow tests/test_compiled.py`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig
from orpheus_tts_plugin.codec.decoder import StreamingDecoder
from orpheus_tts_plugin.codec.snac import load_snac
from tests.served import assert_same_audio, pcm_of
from tests.stubs import started
from tests.test_decoder import random_frames, steady_chunks
from tests.test_engine_under_load import SIX

STREAMS = 1  # the module's decoders and engines: one geometry, so the first test's compilation serves them all


@pytest.mark.parametrize("streams", [STREAMS, pytest.param(2, marks=pytest.mark.slow)])
def test_the_compiled_decoder_decodes_what_the_eager_one_does(tiny_snac, streams: int) -> None:
    frames = np.stack([random_frames(7, 40 + i) for i in range(streams)])
    compiled = StreamingDecoder(tiny_snac, max_streams=streams, compile=True)
    progress: list[tuple[int, int]] = []
    compiled.warm(lambda done, total: progress.append((done, total)))
    assert progress[-1] == (len(compiled.buckets()),) * 2
    eager = steady_chunks(StreamingDecoder(tiny_snac, max_streams=streams), frames)
    for a, b in zip(steady_chunks(compiled, frames), eager):
        assert np.abs(np.concatenate(a).astype(int) - np.concatenate(b).astype(int)).max() <= 2


async def test_a_compiled_engine_warms_every_bucket_at_start_and_speaks_as_the_eager_one(
    synthetic_config: EngineConfig,
) -> None:
    config = replace(synthetic_config, max_streams=STREAMS)
    async with started(config) as eager:
        expected = await pcm_of(eager, SIX, seed=3)
    async with started(replace(config, compile=True)) as compiled:
        calls = compiled.stats()["decoder_calls"]  # the warm-up ran every bucket before start() returned
        assert_same_audio(await pcm_of(compiled, SIX, seed=3), expected)
        assert calls == 0 and compiled.stats()["decoder_calls"] > 0


def test_compiled_decoders_made_later_in_the_process_compile_every_bucket_too(
    test_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each bucket either compiles or reuses a compiled entry whose guards hold; none falls back to eager
    at dynamo's recompile limit (it logs "hit config.recompile_limit" when it does)."""
    from torch._dynamo.utils import counters

    before = dict(counters["frames"])
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for _ in range(3):  # a fresh SNAC each time, as an engine restarted in-process loads one
            StreamingDecoder(load_snac(str(test_model_dir / "snac")), max_streams=STREAMS, compile=True).warm()
    compiled = counters["frames"]["ok"] - before.get("ok", 0)
    assert compiled == counters["frames"]["total"] - before.get("total", 0)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
