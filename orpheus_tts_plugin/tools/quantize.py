"""FP8 post-training quantisation of an Orpheus checkpoint with NVIDIA ModelOpt, for TensorRT-LLM and vLLM.

Every Linear layer but lm_head gets FP8 (E4M3) weights and activations with per-tensor scales, and the KV cache
gets FP8 scales, calibrated ("max") on ~32 varied Orpheus prompts, each followed by audio tokens that the model
itself generates: serving time is spent on audio positions, so their activation and K/V ranges must be seen.
Output: a Hugging Face checkpoint with `hf_quant_config.json` (loaded by the TensorRT-LLM PyTorch backend and
by vLLM) or, with fmt="trtllm", a TensorRT-LLM checkpoint for the legacy engine-build flow (TensorRT-LLM <= 1.3.0rc20;
refused where a later TensorRT-LLM is installed).
What has and has not run of it: docs/backends.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..backends.trtllm_lines import engine_build_missing
from ..spec import ModelSpec, spec_for
from ..speech.prompt import prompt_ids

INSTALL_HINT = "FP8 quantisation needs NVIDIA ModelOpt: pip install nvidia-modelopt (it is in the TensorRT-LLM image)"
FORMATS = ("hf", "trtllm")

# Varied lengths, punctuation, numbers, questions, emotion and inline tags, as a voice agent speaks them.
CALIBRATION_TEXTS: tuple[str, ...] = (
    "Hello! Thanks for calling, how can I help you today?",
    "Your appointment is confirmed for Tuesday, March fourth, at ten fifteen in the morning.",
    "I'm sorry, I didn't quite catch that. Could you say it again?",
    "Sure, let me check that for you. <sigh> One moment, the system is a little slow today.",
    "That's hilarious! <laugh> I can't believe he actually did that.",
    "The total comes to forty-two dollars and fifty cents, including tax.",
    "Please hold while I transfer you to the billing department.",
    "Okay.",
    "Yes, absolutely.",
    "Hmm, let me think about that for a second.",
    "Your order number is A, seven, four, nine, two. It shipped yesterday and should arrive on Friday.",
    "Oh no, I'm really sorry to hear that. <gasp> Is everyone alright?",
    "Would you like me to send a confirmation by text message or by email?",
    "The weather tomorrow looks sunny, with a high of seventy-one degrees and a light breeze from the west.",
    "I totally understand your frustration, and I'm going to do everything I can to fix this for you.",
    "Wait, what? <chuckle> No, no, that's not what I meant at all.",
    "To reset your password, open the app, tap settings, then choose security and follow the steps.",
    "Good morning! It's a beautiful day, isn't it?",
    "Unfortunately, we don't have any tables available at seven. How about eight thirty instead?",
    "Can you spell your last name for me, please?",
    "That's correct: one, two, three, Main Street, apartment four B, Springfield.",
    "<cough> Excuse me. As I was saying, the meeting has been moved to Thursday afternoon.",
    "I'm so excited for you! This is such wonderful news!",
    "Honestly, I'm not sure. <groan> Let me ask my supervisor and get back to you.",
    "Your balance is one thousand two hundred and seven dollars. Your next payment is due on the first.",
    "Is there anything else I can help you with today?",
    "Thank you so much for your patience. Have a wonderful evening!",
    "Sorry, the line is breaking up. Can you hear me now?",
    "We open at nine a.m. on weekdays and ten on weekends; we're closed on public holidays.",
    "Right, so first you'll want to unplug the router, wait about thirty seconds, and then plug it back in.",
    "<yawn> Long day. Anyway, where were we? Ah yes, your refund.",
    "Perfect. I've booked it. You'll get a reminder the day before. Bye for now!",
)


def import_modelopt() -> SimpleNamespace:
    """ModelOpt's quantisation and export entry points; ImportError saying how to get them if missing."""
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return SimpleNamespace(
        mtq=mtq,
        export_hf_checkpoint=export_hf_checkpoint,
        export_tensorrt_llm_checkpoint=export_tensorrt_llm_checkpoint,
    )


def fp8_config(mtq: Any, kv_cache: bool = True) -> dict[str, Any]:
    """FP8_DEFAULT_CFG plus FP8 KV-cache quantisers (rule lists in ModelOpt >= 0.4x, pattern dicts before)."""
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if kv_cache:
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if isinstance(cfg["quant_cfg"], dict):
            cfg["quant_cfg"].update(kv)
        else:
            cfg["quant_cfg"] = [*cfg["quant_cfg"], *kv]
    return cfg


def calibration_prompts(tokenizer: Any, spec: ModelSpec, texts: Sequence[str]) -> list[tuple[int, ...]]:
    """Orpheus prompt ids for each text, cycling through the model family's voices."""
    voices = spec.voices or (None,)
    return [prompt_ids(tokenizer, spec, text, voices[i % len(voices)]) for i, text in enumerate(texts)]


def calibration_sequences(
    model: Any,
    prompts: Sequence[tuple[int, ...]],
    spec: ModelSpec,
    gen_tokens: int,
    seed: int = 0,
    batch_size: int = 32,
) -> list[list[int]]:
    """Each prompt followed by up to `gen_tokens` audio ids the model samples itself (production sampling)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    if gen_tokens <= 0:
        return [list(p) for p in prompts]

    device = next(model.parameters()).device
    bias = torch.full((model.config.vocab_size,), float("-inf"), device=device)
    bias[list(spec.audio_ids)] = 0.0

    class AudioOnly(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores + bias

    out: list[list[int]] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), spec.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, p in enumerate(batch):  # left padding: generation continues every row at the same column
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            gen = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=gen_tokens,
                do_sample=True,
                temperature=0.6,
                top_p=0.8,
                repetition_penalty=1.1,
                eos_token_id=spec.end_of_speech,
                pad_token_id=spec.pad,
                logits_processor=LogitsProcessorList([AudioOnly()]),
            )[:, width:].tolist()
            for p, new in zip(batch, gen):
                if spec.end_of_speech in new:
                    new = new[: new.index(spec.end_of_speech) + 1]
                out.append([*p, *new])
    return out


def quantize(
    model: str,
    out: str | Path,
    *,
    calib_texts: Sequence[str] | None = None,
    model_family: str | None = None,
    gen_tokens: int = 256,
    fmt: str = "hf",
    device: str | None = None,
    dtype: str = "bfloat16",
    kv_cache: bool = True,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """Quantise `model` (hub id or directory) to FP8 with ModelOpt and write the checkpoint and tokenizer to `out`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    refusal = engine_build_missing() if fmt == "trtllm" else None
    if refusal:
        raise ValueError(refusal)
    mo = import_modelopt()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = spec_for(model_family)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype)
    texts = list(calib_texts) if calib_texts is not None else list(CALIBRATION_TEXTS)
    if not texts:
        raise ValueError("calibration needs at least one text")
    out = Path(out)
    t0 = time.monotonic()

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval()
    log(f"loaded {model} on {device} ({dtype}) in {time.monotonic() - t0:.1f} s")
    sequences = calibration_sequences(lm, calibration_prompts(tokenizer, spec, texts), spec, gen_tokens, seed)
    n_tokens = sum(map(len, sequences))
    log(f"calibration: {len(sequences)} prompts + up to {gen_tokens} generated audio tokens each ({n_tokens} tokens)")

    def forward_loop(m: Any) -> None:
        decoder = m.get_decoder()  # every quantised layer, without the (unquantised) vocab-sized lm_head
        with torch.no_grad():
            for seq in sequences:
                decoder(input_ids=torch.tensor([seq], device=device))

    lm = mo.mtq.quantize(lm, fp8_config(mo.mtq, kv_cache), forward_loop)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if fmt == "hf":
            mo.export_hf_checkpoint(lm, dtype=torch_dtype, export_dir=out)
        else:
            mo.export_tensorrt_llm_checkpoint(
                lm, decoder_type="llama", dtype=torch_dtype, export_dir=out, inference_tensor_parallel=1
            )
    _write_rope_fields(out, fmt, *_rope(lm.config))
    tokenizer.save_pretrained(out)
    record = {
        "source": model,
        "format": fmt,
        "weights": "fp8",
        "kv_cache": "fp8" if kv_cache else None,
        "calibration_prompts": len(sequences),
        "calibration_tokens": n_tokens,
        "gen_tokens": gen_tokens,
        "seed": seed,
        "modelopt": _version("nvidia-modelopt"),
    }
    (out / "orpheus_quantization.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote FP8 {fmt} checkpoint to {out} in {time.monotonic() - t0:.1f} s")
    return out


def _rope(config: Any) -> tuple[float | None, dict[str, Any] | None]:
    """RoPE theta and scaling from a transformers config (5.x `rope_parameters` or 4.x `rope_theta`/`rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", None)
        return theta, (scaling if scaling.get("rope_type", "default") != "default" else None)
    return getattr(config, "rope_theta", None), getattr(config, "rope_scaling", None)


def _write_rope_fields(out: Path, fmt: str, theta: float | None, scaling: dict[str, Any] | None) -> None:
    """Write RoPE the way the serving engines read it: llama3 scaling and theta 500000 must not be lost.

    transformers 5 saves only `rope_parameters`, which the transformers 4.x inside TensorRT-LLM 1.2 and vLLM
    ignore (they would fall back to theta 10000, no scaling); ModelOpt's TensorRT-LLM export omits RoPE too.
    """
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    if fmt == "hf":
        cfg.pop("rope_parameters", None)
        if theta is not None:
            cfg["rope_theta"] = theta
        if scaling is not None:
            cfg["rope_scaling"] = scaling
        if "dtype" in cfg:
            cfg.setdefault("torch_dtype", cfg["dtype"])
    else:
        if theta is not None:
            cfg["rotary_base"] = theta
        if scaling is not None:
            cfg["rotary_scaling"] = {"type": scaling.get("rope_type"), **scaling}
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `orpheus-tts quantize` options."""
    parser.add_argument("--model", required=True, help="Orpheus checkpoint: hub id or local directory")
    parser.add_argument("--out", required=True, help="output directory for the FP8 checkpoint")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="hf",
        help="hf: for TensorRT-LLM (PyTorch backend) and vLLM; trtllm: TensorRT engine-build flow",
    )
    parser.add_argument("--calib-file", help="calibration texts, one per line (default: the built-in set of 32)")
    parser.add_argument(
        "--gen-tokens",
        type=int,
        default=256,
        help="audio tokens generated after each calibration prompt (0: prompts only)",
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the unquantised parts")
    parser.add_argument("--no-kv-cache", action="store_true", help="leave the KV cache unquantised")
    parser.add_argument("--model-family", default=None, help="token ids and voices (default: orpheus-en)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration's sampling")


def quantize_main(args: argparse.Namespace) -> int:
    """Run `orpheus-tts quantize` from parsed arguments."""
    texts = None
    if args.calib_file:
        texts = [line.strip() for line in Path(args.calib_file).read_text().splitlines() if line.strip()]
    quantize(
        args.model,
        args.out,
        calib_texts=texts,
        model_family=args.model_family,
        gen_tokens=args.gen_tokens,
        fmt=args.format,
        device=args.device,
        dtype=args.dtype,
        kv_cache=not args.no_kv_cache,
        seed=args.seed,
    )
    return 0
