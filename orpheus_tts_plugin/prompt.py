"""Prompt token ids: [start of human] + tokenizer("voice: text") + [eot, end of human, start of AI, start of speech]."""

from __future__ import annotations

from typing import Protocol

from .spec import ModelSpec


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that prompts need."""

    def __call__(self, text: str) -> dict: ...


def prompt_ids(tokenizer: Tokenizer, spec: ModelSpec, text: str, voice: str | None) -> tuple[int, ...]:
    """Token ids of one utterance's prompt; the tokenizer adds BOS (exactly one)."""
    body = f"{voice}: {text}" if voice else text
    ids = list(tokenizer(body)["input_ids"])
    if not ids or ids[0] != spec.bos:
        ids.insert(0, spec.bos)
    while len(ids) > 1 and ids[1] == spec.bos:
        del ids[1]
    return (spec.start_of_human, *ids, *spec.prompt_suffix())


def token_budget(text: str, per_char: float, base: int, max_tokens: int) -> tuple[int, str]:
    """Generation cap for `text`: the smaller of a text-length budget and max_tokens, and which it is.

    About 83 tokens make a second of audio and speech runs ~15 characters a second, so
    `per_char` ≈ 6 is natural speed; the default leaves room for slow speech and tags.
    """
    budget = base + int(per_char * len(text))
    budget = -(-budget // 7) * 7
    if budget < max_tokens:
        return budget, "budget"
    return max_tokens, "max_tokens"
