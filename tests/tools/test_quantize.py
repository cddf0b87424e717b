"""`orpheus-tts quantize`: real NVIDIA ModelOpt FP8 PTQ of the tiny test model on CPU, HF and TensorRT-LLM exports."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.tools.quantize import (
    CALIBRATION_TEXTS,
    add_arguments,
    calibration_prompts,
    calibration_sequences,
    fp8_config,
    quantize,
    quantize_main,
)

SPEC = ENGLISH
PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
CALIB = CALIBRATION_TEXTS[:3]


@pytest.fixture(scope="module")
def model_dir(test_model_dir: Path) -> Path:
    """The tiny Orpheus-shaped checkpoint from the session's shared test model (tests/conftest.py)."""
    return test_model_dir / "orpheus"


@pytest.fixture(scope="module")
def quantized(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI path: `orpheus-tts quantize --model M --out DIR --calib-file F --gen-tokens 14`."""
    pytest.importorskip("modelopt.torch.quantization", reason="needs nvidia-modelopt")
    work = tmp_path_factory.mktemp("quantized")
    calib = work / "calib.txt"
    calib.write_text("\n".join(CALIB) + "\n\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(model_dir),
            "--out",
            str(work / "fp8"),
            "--calib-file",
            str(calib),
            "--gen-tokens",
            "14",
            "--device",
            "cpu",
        ]
    )
    assert quantize_main(args) == 0
    return work / "fp8"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_linear_weights_are_fp8_with_scales_and_kv_cache_scales(quantized: Path) -> None:
    t = tensors(quantized / "model.safetensors")
    for layer in range(2):
        for proj in PROJ:
            name = f"model.layers.{layer}.{proj}"
            assert t[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
            for scale in ("weight_scale", "input_scale"):
                value = t[f"{name}.{scale}"].float()
                assert value.numel() == 1 and torch.isfinite(value).all() and value.item() > 0, (name, scale)
        for kv in ("k", "v"):
            value = t[f"model.layers.{layer}.self_attn.{kv}_proj.{kv}_scale"].float()
            assert torch.isfinite(value).all() and value.item() > 0
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings / tied lm_head stay unquantised
    assert not any("lm_head" in k and t[k].dtype == torch.float8_e4m3fn for k in t)


def test_dequantized_weights_match_the_original(quantized: Path, model_dir: Path) -> None:
    q, orig = tensors(quantized / "model.safetensors"), tensors(model_dir / "model.safetensors")
    for layer in range(2):
        for proj in PROJ:
            name = f"model.layers.{layer}.{proj}"
            w, scale = orig[f"{name}.weight"].float(), q[f"{name}.weight_scale"].float()
            deq = q[f"{name}.weight"].float() * scale
            # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step near 0.
            bound = w.abs().bfloat16().float() * 2**-4 + scale * 2**-9 + w.abs() * 2**-8
            assert torch.all((deq - w).abs() <= bound), name
            assert scale.item() == pytest.approx(w.abs().max().item() / 448.0, rel=0.01)  # max calibration


def test_config_declares_modelopt_fp8_and_keeps_llama3_rope(quantized: Path) -> None:
    from transformers import AutoConfig

    cfg = json.loads((quantized / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "FP8"
    assert qc["kv_cache_scheme"]["num_bits"] == 8 and qc["kv_cache_scheme"]["type"] == "float"
    hf_quant = json.loads((quantized / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "FP8" and hf_quant["kv_cache_quant_algo"] == "FP8"
    # transformers 4.x (inside TensorRT-LLM and vLLM) reads these two fields, not `rope_parameters`
    assert cfg["rope_theta"] == 500000.0 and "rope_parameters" not in cfg
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    loaded = AutoConfig.from_pretrained(quantized)
    assert loaded.rope_parameters["rope_theta"] == 500000.0 and loaded.rope_parameters["rope_type"] == "llama3"


def test_tokenizer_and_record_are_shipped(quantized: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quantized)
    assert len(tok) == SPEC.vocab_size and tok("tara: hi").input_ids[0] == SPEC.bos
    assert tok.convert_tokens_to_ids("<custom_token_10>") == SPEC.first_audio_token
    record = json.loads((quantized / "orpheus_quantization.json").read_text())
    assert record["calibration_prompts"] == len(CALIB) and record["gen_tokens"] == 14
    assert record["weights"] == "fp8" and record["kv_cache"] == "fp8" and record["modelopt"]


def test_calibration_continues_prompts_with_audio_ids_only(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = calibration_prompts(tok, SPEC, CALIB)
    assert [p[0] for p in prompts] == [SPEC.start_of_human] * 3
    assert tok.decode(prompts[1][2:8]).startswith(f"{SPEC.voices[1]}:")  # voices cycle
    seqs = calibration_sequences(model, prompts, SPEC, 10, seed=1)
    for p, seq in zip(prompts, seqs):
        new = seq[len(p) :]
        assert tuple(seq[: len(p)]) == p and 1 <= len(new) <= 10
        assert all(SPEC.first_audio_token <= i < SPEC.audio_token_end or i == SPEC.end_of_speech for i in new)
    assert calibration_sequences(model, prompts, SPEC, 10, seed=1) == seqs  # seeded
    assert calibration_sequences(model, prompts, SPEC, 0) == [list(p) for p in prompts]


def test_fp8_config_adds_kv_cache_quantizers() -> None:
    mtq = pytest.importorskip("modelopt.torch.quantization")
    names = [rule.get("quantizer_name") for rule in fp8_config(mtq)["quant_cfg"]]
    assert names[-1] == "*[kv]_bmm_quantizer" and "*weight_quantizer" in names and "*input_quantizer" in names
    assert "*[kv]_bmm_quantizer" not in [r.get("quantizer_name") for r in fp8_config(mtq, False)["quant_cfg"]]
    assert mtq.FP8_DEFAULT_CFG["quant_cfg"][-1].get("quantizer_name") != "*[kv]_bmm_quantizer"  # not mutated

    class OldStyle:  # ModelOpt before 0.4x: patterns → settings
        FP8_DEFAULT_CFG = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3)}}, "algorithm": "max"}
        FP8_KV_CFG = {"quant_cfg": {"*[kv]_bmm_quantizer": {"num_bits": (4, 3)}}}

    assert set(fp8_config(OldStyle)["quant_cfg"]) == {"*weight_quantizer", "*[kv]_bmm_quantizer"}


def test_tensorrt_llm_checkpoint_export(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("modelopt.torch.quantization", reason="needs nvidia-modelopt")
    out = quantize(
        str(model_dir),
        tmp_path / "trt",
        calib_texts=CALIB[:1],
        gen_tokens=7,
        fmt="trtllm",
        device="cpu",
        log=lambda _: None,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "FP8" and cfg["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert cfg["rotary_base"] == 500000.0 and cfg["rotary_scaling"]["type"] == "llama3"
    assert cfg["rotary_scaling"]["factor"] == 32.0
    t = tensors(out / "rank0.safetensors")
    assert sum(v.dtype == torch.float8_e4m3fn for v in t.values()) == 2 * (len(PROJ) - 2)  # q,k,v fused: qkv
    assert all(t[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].item() > 0 for i in range(2))


def test_missing_modelopt_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)
    with pytest.raises(ImportError, match="pip install nvidia-modelopt"):
        quantize("unused", tmp_path)


def test_rejects_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fmt"):
        quantize("unused", tmp_path, fmt="gguf")
