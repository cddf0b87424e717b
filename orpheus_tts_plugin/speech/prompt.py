"""What each sentence asks of a backend: its prompt ids, its token budget, its request.

Prompt: [start of human] + tokenizer("voice: text") + [eot, end of human, start of AI, start of speech].
A cloned voice's prompt: its reference turn (`reference_prompt`), then the text's prompt without a voice name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from ..backends.protocol import GenerationRequest
from ..config import SEED_LIMIT, EngineConfig
from ..spec import CODEBOOK_SIZE, TOKENS_PER_FRAME, ModelSpec
from ..types import SpeechOptions


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


def reference_prompt(tokenizer: Tokenizer, spec: ModelSpec, transcript: str, frames: np.ndarray) -> tuple[int, ...]:
    """A cloned voice's reference turn: what precedes the prompt of every sentence it speaks.

    [start of human] + tokenizer(transcript) + [eot, end of human, start of AI, start of speech]
    + the reference's audio ids (frame by frame, 7 a frame in `FRAME_LEVELS` order) + [end of speech, end of AI].
    That is Canopy's zero-shot layout for the pretrained checkpoint: canopyai/Orpheus-TTS,
    colabs/Orpheus_0_1_Pretrain_Inference.ipynb ("Tokenising your stuff for the prompt": zeroprompt_input_ids =
    start_tokens + transcript + end_tokens + audio codes + final_tokens [128258, 128262], then per text
    start_tokens + text + end_tokens; last at commit 184a666, removed from the repository in 00b3207).
    """
    frames = np.asarray(frames, dtype=np.int64)
    if frames.ndim != 2 or frames.shape[1] != TOKENS_PER_FRAME or len(frames) == 0:
        raise ValueError(f"reference frames must be (n >= 1, {TOKENS_PER_FRAME}), got shape {frames.shape}")
    audio = spec.first_audio_token + np.arange(TOKENS_PER_FRAME) * CODEBOOK_SIZE + frames
    return (*prompt_ids(tokenizer, spec, transcript, None), *audio.ravel().tolist(), spec.end_of_speech, spec.end_of_ai)


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


def sentence_requests(
    stream_id: str,
    sentences: Sequence[str],
    options: SpeechOptions,
    tokenizer: Tokenizer,
    spec: ModelSpec,
    cfg: EngineConfig,
    reference: tuple[int, ...] = (),
) -> list[tuple[GenerationRequest, str]]:
    """One request per sentence, with which limit caps it ("budget" or "max_tokens").

    `reference`: a cloned voice's reference turn (`reference_prompt`), the shared prefix of every sentence's prompt
    (`prefix_len`), followed by the sentence's prompt without a voice name.

    Sentence i is seeded with seed + i (wrapping below 2**63), so it equals that sentence spoken alone with
    seed + i; every sentence after the first goes before new streams (`priority`).
    """
    out = []
    for i, text in enumerate(sentences):
        sampling = options.sampling
        limit, kind = token_budget(text, cfg.token_budget_per_char, cfg.token_budget_base, sampling.max_tokens)
        seed = None if sampling.seed is None else (sampling.seed + i) % SEED_LIMIT
        request = GenerationRequest(
            request_id=f"{stream_id}-{i}",
            prompt_ids=(*reference, *prompt_ids(tokenizer, spec, text, None if reference else options.voice)),
            sampling=replace(sampling, seed=seed),
            max_new_tokens=limit,
            stop_ids=spec.stop_ids(),
            constrain_audio=cfg.constrain_audio,
            priority=i > 0,
            prefix_len=len(reference),
            adapter=options.adapter,
        )
        out.append((request, kind))
    return out
