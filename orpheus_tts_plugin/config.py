"""The engine's options as plain frozen dataclasses, each checked once, where it is built.

Imports nothing of the package, so every module (engine, backends, adapters, tools) can use it.
A bad value raises TypeError or ValueError naming the field and its allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

SEED_LIMIT = 2**63  # seeds are int64 in every backend: [0, 2**63)
# Characters of text one synthesize() call (or one request to `orpheus-tts serve`) takes: OpenAI's limit for `input`.
MAX_TEXT_CHARS = 4096


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    """TypeError unless `value` is an int; ValueError unless lo <= value (< hi)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int {bound}, got {value}")


def check_text_length(
    text: str, limit: int | None, whose: str, error: type[ValueError] = ValueError, remedy: str = ""
) -> None:
    """`error` naming `whose` limit (and `remedy`) if `text` is longer than `limit` characters (None: no limit)."""
    if limit is not None and len(text) > limit:
        raise error(f"text of {len(text)} characters is over {whose} limit of {limit}{remedy}")


def check_number(name: str, value: object, *, lo: float, lo_open: bool = False, hi: float | None = None) -> None:
    """TypeError unless `value` is a real number; ValueError unless finite and in range (hi inclusive)."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    low_ok = value > lo if lo_open else value >= lo
    if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        bound = f"in {left}{lo:g}, {hi:g}]" if hi is not None else f"finite and {'>' if lo_open else '>='} {lo:g}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


SPEED_RANGE = (0.25, 4.0)  # OpenAI's `speed`: the audio's tempo, stretched after decoding (pitch kept)


def check_speed(speed: object) -> float:
    """`speed` as a float: TypeError unless a number, ValueError naming the range unless in SPEED_RANGE."""
    check_number("speed", speed, lo=SPEED_RANGE[0], hi=SPEED_RANGE[1])
    return float(speed)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (Baseten's production defaults)."""

    temperature: float = 0.6
    top_p: float = 0.8
    repetition_penalty: float = 1.1
    max_tokens: int = 6144
    # Same request alone, same config and device: same tokens. Beside other streams a nearly tied token can flip with
    # the batch's float rounding, unless the hf backend's `batch_invariant` steps (docs/engine.md, "Seeds").
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Raise TypeError/ValueError naming the field and its range; return self."""
        check_number("temperature", self.temperature, lo=0.0)
        check_number("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, SEED_LIMIT)
        return self


@dataclass(frozen=True)
class SamplingOverrides:
    """Per-request sampling changes: None leaves the engine's default. The one type every adapter passes on."""

    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    seed: int | None = None

    @classmethod
    def of(cls, base: SamplingOverrides | None = None, **changes: Any) -> SamplingOverrides:
        """`base` (or no overrides) with `changes` applied; TypeError naming an unknown field."""
        unknown = set(changes) - set(SAMPLING_FIELDS)
        if unknown:
            names, known = ", ".join(sorted(unknown)), ", ".join(SAMPLING_FIELDS)
            raise TypeError(f"unknown sampling option(s) {names}; known: {known}")
        return replace(base or cls(), **changes)

    def given(self) -> dict[str, Any]:
        """The fields that are set."""
        return {f: getattr(self, f) for f in SAMPLING_FIELDS if getattr(self, f) is not None}

    def apply(self, base: SamplingParams) -> SamplingParams:
        """`base` with these overrides, validated."""
        return replace(base, **self.given()).validate()


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingOverrides))


@dataclass(frozen=True)
class SyntheticConfig:
    """How the synthetic (model-free) backend behaves.

    `frames_per_prompt_token` sets the utterance length from the prompt length (real speech
    is about 1.5 frames per text token); `fault_every` > 0 replaces every Nth id with a
    non-audio id, to exercise the parser's recovery through the whole engine. `endless` utterances
    never stop by themselves (their frames repeat): they end only by an abort or a token cap, so a test of
    cancellation never depends on how fast the host generates.
    """

    tokens_per_second: float = 0.0  # per stream; 0 = as fast as the thread can step
    frames_per_prompt_token: float = 1.5
    min_frames: int = 4
    fault_every: int = 0
    endless: bool = False

    def __post_init__(self) -> None:
        check_number("tokens_per_second", self.tokens_per_second, lo=0.0)
        check_number("frames_per_prompt_token", self.frames_per_prompt_token, lo=0.0)
        check_int("min_frames", self.min_frames, 1)
        check_int("fault_every", self.fault_every, 0)
        if not isinstance(self.endless, bool):
            raise TypeError(f"endless must be a bool, got {type(self.endless).__name__}")


BACKENDS = ("hf", "synthetic", "trtllm", "vllm", "openai-completions", "remote")
# Backends whose model runs on an OpenAI-compatible completions server; "remote" is the old name of
# "openai-completions", with the server's URL in `model` unless `completions_url` is set.
COMPLETIONS_BACKENDS = ("openai-completions", "remote")
DECODERS = ("snac", "null")
ADAPTERLESS_BACKENDS = ("openai-completions", "remote")


def _named_pairs(field: str, value: object) -> tuple[tuple[str, str], ...]:
    """A mapping (or pairs) of non-empty str names to non-empty str values, as sorted pairs; TypeError/ValueError."""
    try:
        pairs = sorted(dict(value).items())  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"{field} must be a mapping of names to str, got {type(value).__name__}") from None
    for key, item in pairs:
        if not isinstance(key, str) or not key or not isinstance(item, str) or not item:
            raise ValueError(f"{field} must map non-empty str names to non-empty str, got {key!r}: {item!r}")
    return tuple(pairs)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that defines an engine; equal configs share one process-wide engine."""

    model: str | None = "canopylabs/orpheus-3b-0.1-ft"  # hub id or local dir (remote, the old name: the server URL)
    snac: str = "hubertsiuzdak/snac_24khz"
    backend: str = "hf"  # hf | synthetic | trtllm | vllm | openai-completions (remote: its old name)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    model_family: str = "orpheus-en"
    tokenizer: str | None = None  # defaults to `model`
    max_streams: int = 64  # concurrent synthesize() streams admitted; more raise EngineOverloadedError
    max_batch_size: int | None = None  # rows per backend step; None: max_streams (a stream needs one row at a time)
    queue_timeout_s: float = 2.0  # longest wait for a request's first token (queued behind a full batch)
    max_seq_len: int = 4096
    first_chunk_frames: int = 4  # frames before the first decode: 4 → 3,435 exact samples after 28 tokens
    decoder: str = "snac"  # snac | null (silence on the same schedule, for benchmarks)
    decode_batch_frames: int | None = None  # frames (rows × chunk) per decoder call; None: max_streams
    decode_ahead_s: float | None = 0.5  # a stream this far ahead of real time is decoded several frames a call
    pause_unread_s: float | None = 2.0  # a stream's generation pauses while its caller has this much audio unread
    compile: bool = False  # torch.compile the decoder step; on CUDA also capture it as graphs (hf's always are)
    noise_seed: int = 0
    sentence_max_chars: int = 300
    # Characters one synthesize() call takes; longer raises ValueError at once (None: no limit). Agents pass LLM text
    # a sentence at a time; a whole book in one call would hold a stream (and a core) for minutes.
    max_text_chars: int | None = MAX_TEXT_CHARS
    token_budget_per_char: float = 12.0
    token_budget_base: int = 350
    constrain_audio: bool = True  # restrict sampling to the ids valid at each frame position
    sampling: SamplingParams = SamplingParams()
    synthetic: SyntheticConfig = SyntheticConfig()
    backend_options: tuple[tuple[str, Any], ...] = ()  # extra keyword arguments for the backend
    completions_url: str | None = None  # openai-completions: the server's URL (`model` names the tokenizer)
    # LoRA adapters (PEFT folders or hub ids) by name, served beside the base model in the same batches; a dict is
    # kept as sorted (name, path) pairs, so that the config stays hashable.
    adapters: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    # Fine-tuned voices: voice name -> the adapter that speaks it (the name is a voice of the engine from then on).
    adapter_voices: Mapping[str, str] | tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.backend in COMPLETIONS_BACKENDS:
            if not self.completions_server:
                raise ValueError(f"backend {self.backend!r} needs completions_url, the server's URL")
            if self.completions_url is None and self.tokenizer is None:
                raise ValueError("backend 'remote': model is the server URL; set tokenizer")
        elif self.completions_url is not None:
            raise ValueError(f"completions_url is for backend 'openai-completions', not {self.backend!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"unknown decoder {self.decoder!r}; choose one of {', '.join(DECODERS)}")
        check_int("max_streams", self.max_streams, 1)
        if self.max_batch_size is not None:
            check_int("max_batch_size", self.max_batch_size, 1)
        check_number("queue_timeout_s", self.queue_timeout_s, lo=0.0, lo_open=True)
        if self.decode_batch_frames is not None:
            check_int("decode_batch_frames", self.decode_batch_frames, 1)
        for name in ("decode_ahead_s", "pause_unread_s"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), lo=0.0)
        check_int("max_seq_len", self.max_seq_len, 2)
        check_int("first_chunk_frames", self.first_chunk_frames, 1)
        check_int("noise_seed", self.noise_seed, 0, SEED_LIMIT)
        check_int("sentence_max_chars", self.sentence_max_chars, 20)
        if self.max_text_chars is not None:
            check_int("max_text_chars", self.max_text_chars, 1)
        check_number("token_budget_per_char", self.token_budget_per_char, lo=0.0)
        check_int("token_budget_base", self.token_budget_base, 0)
        self.sampling.validate()
        for name in ("adapters", "adapter_voices"):
            object.__setattr__(self, name, _named_pairs(name, getattr(self, name)))
        if self.adapters and self.backend in ADAPTERLESS_BACKENDS:
            raise ValueError(f"backend {self.backend!r} cannot serve LoRA adapters; hf, vllm and trtllm can")
        unknown = sorted({a for _, a in self.adapter_voices} - {a for a, _ in self.adapters})
        if unknown:
            raise ValueError(f"adapter_voices names adapter(s) {', '.join(unknown)} not in adapters")

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The names of the LoRA adapters, sorted."""
        return tuple(name for name, _ in self.adapters)

    @property
    def completions_server(self) -> str | None:
        """The completions server's URL: `completions_url`, or `model` under the old name "remote"; else None."""
        if self.backend not in COMPLETIONS_BACKENDS:
            return None
        return self.completions_url or (self.model if self.backend == "remote" else None)

    @property
    def batch_size(self) -> int:
        """Rows per backend step."""
        return self.max_batch_size or self.max_streams
