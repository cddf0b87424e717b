"""A tiny random Orpheus-shaped checkpoint + tokenizer and a random SNAC, in the real on-disk formats.

Build and test machines cannot download weights; `make_test_model(dir)` writes `dir/orpheus` (a
`LlamaForCausalLM` whose tokenizer has the real Orpheus / Llama 3 token ids) and `dir/snac` (the real
24 kHz SNAC architecture, or a narrow one with the same rates), loaded by the same code as the real ones.
`write_lora_adapter(model_dir, out)` writes a random LoRA adapter of it in PEFT's format.
Random weights make noise, not speech. The Llama's attention heads are 32 wide by default (hidden 64, 4 query and 2
KV heads): vLLM's CPU attention supports head sizes 32, 64, 80, ... 512, not 16.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import torch

from ..spec import ENGLISH, SAMPLES_PER_FRAME

SNAC_24KHZ = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
SNAC_TINY = {**SNAC_24KHZ, "encoder_dim": 8, "decoder_dim": 64}
SNAC_CONFIGS = {"full": SNAC_24KHZ, "tiny": SNAC_TINY}
HEAD_DIM = 32  # the smallest head size vLLM's CPU attention runs (cpu_attn.py get_supported_head_sizes)

ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA3_SPECIAL_BASE = 128_000  # id of <|begin_of_text|>, the first of Llama 3's 256 special tokens
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
] + [f"<|reserved_special_token_{n}|>" for n in range(3, 248)]

_CORPUS = """\
Hello there, how are you doing today? I'm doing well, thank you for asking.
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
Please call me back when you get a chance; my number is 555-0123.
It's a beautiful morning, and the birds are singing outside my window.
Can you tell me the way to the nearest train station? Turn left, then walk two blocks.
I'd like to book a table for four people at seven thirty tonight.
Your appointment has been confirmed for Tuesday, March 4th, at 10:15 AM.
Wait, what did you just say? I couldn't hear you over the noise.
Honestly, I think that's the best idea I've heard all week!
The weather forecast calls for rain this afternoon, with temperatures around 68 degrees.
Thank you for calling customer support. How can I help you today?
We're sorry, but all of our agents are busy right now. Please hold.
Oh no, I forgot my keys again. <sigh> This happens every single time.
That's hilarious! <laugh> I can't believe he actually did that.
My order number is A-7 4 9 2, and it still hasn't arrived.
Would you rather travel to the mountains or the beach this summer?
The meeting starts at noon, so don't be late. Bring the quarterly report.
Science is a way of thinking much more than it is a body of knowledge.
Every morning she ran three miles along the river before work.
He paid $42.50 for dinner, which included a 20% tip.
Let me check on that for you. One moment, please.
Are you sure about this? Yes, I'm absolutely sure.
"""
_WORDS = (
    "the a an and or but so if when while because after before although I you he she it we they me him "
    "her us them my your his its our their this that these those here there what which who whom whose "
    "where why how is are was were be been being have has had do does did will would shall should can "
    "could may might must go went gone come came see saw seen know knew think thought say said tell told "
    "ask asked make made take took give gave find found call called feel felt leave left keep kept let "
    "begin seem help talk turn start show hear play run move like live believe hold bring happen write "
    "provide sit stand lose pay meet include continue set learn change lead understand watch follow stop "
    "create speak read allow add spend grow open walk win offer remember love consider appear buy wait "
    "serve die send expect build stay fall cut reach time year people way day man woman child world life "
    "hand part place case week company system program question work government number night point home "
    "water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result morning reason research girl guy moment air teacher force "
    "education good new first last long great little own other old big high different small large next "
    "early young important few public bad same able late hard real best better sure free happy quiet loud "
    "warm cold bright dark quick slow tomorrow yesterday today always never often sometimes really very "
    "just also only still already again ever even almost maybe please thanks hello okay yes no"
).split()


def _corpus() -> list[str]:
    """A few hundred English sentences: the embedded ones plus seeded random word sequences."""
    rng = random.Random(1234)
    lines = _CORPUS.splitlines()
    for _ in range(400):
        words = rng.choices(_WORDS, k=rng.randint(4, 14))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ";", "..."]))
    return lines


def _make_tokenizer(vocab_size: int):
    """Byte-level BPE with the Orpheus id layout: Llama 3 specials at 128000, custom tokens after."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trained.train_from_iterator(_corpus(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Fillers up to 128000 so the special and custom ids are the real ones; no merge ever produces them.
    for i in range(len(vocab), LLAMA3_SPECIAL_BASE):
        vocab[f"<|unused_filler_{i}|>"] = i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS])
    n_custom = vocab_size - LLAMA3_SPECIAL_BASE - 256
    custom = [AddedToken(f"<custom_token_{n}>", special=False, normalized=False) for n in range(n_custom)]
    tok.add_tokens(custom)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, LLAMA3_SPECIAL_BASE)],
    )
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(bos) == LLAMA3_SPECIAL_BASE
    return tok


def _write_orpheus(out: Path, seed: int, head_dim: int = HEAD_DIM) -> None:
    """Tiny random LlamaForCausalLM (Orpheus ids, llama3 RoPE, tied embeddings) + tokenizer in `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = ENGLISH
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,  # independent of hidden_size / heads, as in Llama 3.2
        max_position_embeddings=131072,  # as Llama 3.2 / Orpheus-3B
        rope_scaling=dict(ROPE_SCALING),
        rope_theta=ROPE_THETA,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=spec.bos,
        eos_token_id=spec.end_of_speech,
        pad_token_id=spec.pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        # Stronger layers than HF's init, so that outputs depend on the context, not only on the last id.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(10.0)
                layer.mlp.down_proj.weight.mul_(10.0)
    model.save_pretrained(out, safe_serialization=True)
    # Write the RoPE fields the way the real checkpoint does, so older transformers read them too.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling=dict(ROPE_SCALING), rope_theta=ROPE_THETA, torch_dtype="float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_make_tokenizer(spec.vocab_size),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token=f"<custom_token_{spec.pad - spec.custom_token_base}>",
        model_max_length=131072,
    )
    tokenizer.save_pretrained(out)
    # Name the class as Llama 3 / Orpheus checkpoints do, so that transformers 4.x loads it too.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.pop("backend", None)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def write_snac(out: Path, snac: str = "full", seed: int = 0) -> None:
    """Random SNAC (real 24 kHz config, or narrow 'tiny') as config.json + pytorch_model.bin in `out`."""
    from snac import SNAC

    config = SNAC_CONFIGS[snac]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SNAC(**config).eval()
        # Calibrate the last conv's gain: random codes decode to noise of rms ~0.15, far from tanh saturation.
        last = model.decoder.model[-2].parametrizations.weight.original0
        codes = [torch.randint(0, config["codebook_size"], (1, 4 * s)) for s in (1, 2, 4)]
        for _ in range(3):
            with torch.no_grad():
                audio = model.decode(codes)
            assert audio.shape[-1] == 4 * SAMPLES_PER_FRAME
            rms = audio.pow(2).mean().sqrt().item()
            if 0.1 <= rms <= 0.25:
                break
            with torch.no_grad():
                last.mul_(0.15 / max(rms, 1e-3))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.save(model.state_dict(), out / "pytorch_model.bin")


def make_test_model(out_dir: str | Path, snac: str = "full", seed: int = 0, head_dim: int = HEAD_DIM) -> None:
    """Write `out_dir/orpheus` (tiny random Orpheus + tokenizer) and `out_dir/snac` (random SNAC).

    `snac` is "full" (the real 24 kHz architecture) or "tiny" (narrow, same rates); `head_dim` is the attention
    head width (even). Deterministic given seed.
    """
    if snac not in SNAC_CONFIGS:
        raise ValueError(f"snac must be one of {sorted(SNAC_CONFIGS)}, got {snac!r}")
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 2 (RoPE rotates pairs), got {head_dim!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_orpheus(out / "orpheus", seed, head_dim)
    write_snac(out / "snac", snac, seed)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(
    model_dir: str | Path,
    out: str | Path,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 1,
    targets: tuple[str, ...] = LORA_TARGETS,
    strength: float = 0.5,
) -> Path:
    """A random LoRA adapter of the checkpoint in `model_dir`, written to `out` (returned) as PEFT saves one.

    `out/adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path) and
    `out/adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight`
    (out, r) per target Linear of every layer). A and B are both random (PEFT starts B at zero), B scaled so that
    each module's update `alpha / r * B @ A` has `strength` times the standard deviation of its base weight: the
    adapter changes the tokens, and the logits stay finite. Deterministic given seed.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if not targets or not set(targets) <= set(LORA_TARGETS):
        raise ValueError(f"targets must be some of {', '.join(LORA_TARGETS)}, got {targets!r}")
    model_dir, out = Path(model_dir), Path(out)
    pattern = re.compile(rf"(model\.layers\.\d+\.(?:self_attn|mlp)\.({'|'.join(targets)}))\.weight$")
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in sorted(f.keys()):
            match = pattern.fullmatch(key)
            if match is None:
                continue
            w = f.get_tensor(key).float()
            a = torch.randn(rank, w.shape[1], generator=gen) / w.shape[1] ** 0.5
            b = torch.randn(w.shape[0], rank, generator=gen)
            b *= strength * w.std() / (alpha / rank * (b @ a)).std()
            name = f"base_model.model.{match.group(1)}"
            tensors[f"{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{name}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"{model_dir}: no Linear named {', '.join(targets)} in model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "alpha_pattern": {},
        "base_model_name_or_path": str(model_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def make_test_model_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts make-test-model` from parsed arguments."""
    make_test_model(args.dir, snac=args.snac, seed=args.seed, head_dim=getattr(args, "head_dim", HEAD_DIM))
    print(f"wrote {Path(args.dir) / 'orpheus'} and {Path(args.dir) / 'snac'}")
    for i, adapter in enumerate(getattr(args, "adapter", None) or []):
        write_lora_adapter(Path(args.dir) / "orpheus", adapter, seed=args.seed + 1 + i)
        print(f"wrote LoRA adapter {adapter}")
    return 0
