"""The test checkpoint: Orpheus token ids, config and formats, SNAC architecture, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orpheus_tts_plugin.spec import ENGLISH, SAMPLES_PER_FRAME
from orpheus_tts_plugin.tools.testmodel import SNAC_24KHZ, make_test_model, write_snac


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("testmodel")
    make_test_model(out, snac="full", seed=0)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(model_dir / "orpheus")
    assert isinstance(tok, PreTrainedTokenizerFast)
    return tok


def test_tokenizer_ids_match_orpheus(tokenizer) -> None:
    spec = ENGLISH
    assert len(tokenizer) == spec.vocab_size
    ids = tokenizer("tara: Hello").input_ids
    assert ids[0] == spec.bos and spec.bos not in ids[1:] and max(ids[1:]) < 128_000
    assert tokenizer.bos_token_id == spec.bos
    expected = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eot_id|>": spec.end_of_text,
        "<|reserved_special_token_247|>": 128255,
        "<custom_token_0>": spec.custom_token_base,
        "<custom_token_2>": spec.end_of_speech,
        "<custom_token_10>": spec.first_audio_token,
        "<custom_token_28683>": spec.vocab_size - 1,
    }
    assert tokenizer.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert tokenizer.decode([spec.first_audio_token]) == "<custom_token_10>"
    audio = [spec.audio_token(k, 7) for k in range(7)]
    assert tokenizer.decode(audio) == "".join(f"<custom_token_{i - spec.custom_token_base}>" for i in audio)
    assert tokenizer("<custom_token_5><|eot_id|>", add_special_tokens=False).input_ids == [128261, 128009]


def test_tokenizer_encodes_any_text(tokenizer) -> None:
    text = "Héllo, wörld! 漢字 😀 <laugh> tabs\tand\nnewlines ~`^"
    ids = tokenizer(text).input_ids
    assert ids[0] == ENGLISH.bos
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_the_orpheus_config_and_files_are_in_the_real_formats(model_dir: Path) -> None:
    from transformers import AutoConfig

    orpheus = model_dir / "orpheus"
    raw = json.loads((orpheus / "config.json").read_text())
    assert raw["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert raw["rope_theta"] == 500000.0
    cfg = AutoConfig.from_pretrained(orpheus)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    # head width 32: the smallest vLLM's CPU attention runs; 4 query heads of 32 on a hidden size of 64
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert cfg.vocab_size == ENGLISH.vocab_size
    assert cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (128000, 128258, 128263)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 32.0
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (orpheus / name).is_file()
    size = sum(f.stat().st_size for f in orpheus.iterdir())
    assert size < 100e6


def test_the_orpheus_model_loads_with_tied_embeddings(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir / "orpheus")
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[128259, 128000, 83, 285, 128009, 128260, 128261, 128257]])).logits
    assert logits.shape == (1, 8, ENGLISH.vocab_size) and torch.isfinite(logits).all()


def test_full_snac_is_the_real_architecture(model_dir: Path) -> None:
    from snac import SNAC

    snac_dir = model_dir / "snac"
    assert json.loads((snac_dir / "config.json").read_text()) == SNAC_24KHZ
    model = SNAC.from_pretrained(str(snac_dir))
    gen = torch.Generator().manual_seed(1)
    codes = [torch.randint(0, 4096, (1, n), generator=gen) for n in (4, 8, 16)]
    with torch.inference_mode():
        audio = model.decode(codes)
    assert audio.shape == (1, 1, 4 * SAMPLES_PER_FRAME)
    rms = audio.pow(2).mean().sqrt().item()
    assert 0.05 <= rms <= 0.5
    assert (audio.abs() > 0.99).float().mean().item() < 0.01  # not saturated
    assert audio.std(dim=-1).item() > 0.05  # varies


def test_checkpoints_are_deterministic_given_the_seed(model_dir: Path, tmp_path: Path) -> None:
    make_test_model(tmp_path, snac="tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "orpheus" / name).read_bytes() == (model_dir / "orpheus" / name).read_bytes(), name
    write_snac(tmp_path / "again", "tiny", seed=0)
    write_snac(tmp_path / "other", "tiny", seed=1)
    weights = [(tmp_path / d / "pytorch_model.bin").read_bytes() for d in ("snac", "again", "other")]
    assert weights[0] == weights[1] != weights[2]


def test_tiny_snac_has_the_same_layout(model_dir: Path, tmp_path: Path) -> None:
    from snac import SNAC

    write_snac(tmp_path, "tiny", seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {**SNAC_24KHZ, "decoder_dim": 64, "encoder_dim": 8}
    model = SNAC.from_pretrained(str(tmp_path))
    codes = [torch.randint(0, 4096, (2, n)) for n in (3, 6, 12)]
    with torch.inference_mode():
        audio = model.decode(codes)
    assert audio.shape == (2, 1, 3 * SAMPLES_PER_FRAME)
    assert 0.05 <= audio.pow(2).mean().sqrt().item() <= 0.5


def test_an_unknown_snac_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="snac"):
        make_test_model(tmp_path, snac="medium")


def test_head_dim_can_be_chosen_and_the_model_still_runs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    make_test_model(tmp_path, snac="tiny", head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "orpheus")
    assert model.config.head_dim == 16 and model.model.layers[0].self_attn.q_proj.out_features == 4 * 16
    with torch.no_grad():
        logits = model(torch.tensor([[128259, 128000, 83, 128009, 128260, 128261, 128257]])).logits
    assert torch.isfinite(logits).all()


def test_make_test_model_command_takes_a_head_dim() -> None:
    from orpheus_tts_plugin.cli import build_parser

    assert build_parser().parse_args(["make-test-model", "d", "--head-dim", "16"]).head_dim == 16
    assert build_parser().parse_args(["make-test-model", "d"]).head_dim == 32


@pytest.mark.parametrize("head_dim", [0, 15, 16.0])
def test_odd_or_non_integer_head_dim_is_refused(tmp_path: Path, head_dim) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        make_test_model(tmp_path, snac="tiny", head_dim=head_dim)


def test_make_test_model_adapter_writes_a_peft_lora_adapter(tmp_path: Path) -> None:
    """`make-test-model DIR --adapter ADIR`: PEFT's files, key names and shapes; random A and B (B not zero)."""
    from safetensors import safe_open

    from orpheus_tts_plugin.cli import main

    assert main(["make-test-model", str(tmp_path / "m"), "--snac", "tiny", "--adapter", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == (
        "LORA",
        8,
        16.0,
        "CAUSAL_LM",
    )
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["base_model_name_or_path"] == str(tmp_path / "m" / "orpheus")
    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert len(keys) == 2 * 7 * 2  # A and B of 7 Linears in each of 2 layers
        a = f.get_tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight")
    assert a.shape == (8, 64) and b.shape == (64, 8)  # k_proj: 2 KV heads of 32 from hidden 64
    assert b.abs().min() > 0 and torch.isfinite(a).all() and torch.isfinite(b).all()
