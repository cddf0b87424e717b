"""The offline responder: stands in for the LLM when the agent runs offline (no model server, no network).

It answers each user turn from a few keyword rules and streams the answer as LLM text frames at an LLM's
pace (`LLMPace`: a time to first token, then tokens per second), so everything after it (sentence
aggregation, Orpheus TTS, interruption) runs, and is timed, as with an LLM.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from pipecat.frames.frames import (
    Frame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
)
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("hour", "open", "close", "saturday", "sunday"),
        "We are open from nine to five on weekdays. On Saturdays we open at ten and close at four. "
        "We are closed on Sundays.",
    ),
    (
        ("book", "table", "reserv", "tonight", "people"),  # pocketsphinx hears "two people" best of the request
        "Of course, I can book a table for you. What time would you like, and how many people are coming?",
    ),
)
FALLBACK = "Thanks for calling. I heard you say: {heard}. Could you tell me a little more about what you need?"
NOT_HEARD = "Sorry, I did not catch that. Could you say it again, please?"


def reply_to(heard: str) -> str:
    """The canned answer to one user turn."""
    words = heard.lower()
    for keywords, answer in RULES:
        if any(k in words for k in keywords):
            return answer
    return FALLBACK.format(heard=heard) if heard.strip() else NOT_HEARD


@dataclass(frozen=True)
class LLMPace:
    """How fast an LLM answers: the first token `ttft_s` after the request, then `tokens_per_s`.

    Defaults: Llama-3.1-8B-Instruct co-located on one H100 under vLLM (fp16), 16 requests at once:
    TTFT p50 41.7 ms, time per output token p50 10.9 ms (~91 tokens/s); InferenceBench's concurrency
    sweep, https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/ (README: the hosted figure).
    """

    ttft_s: float = 0.042
    tokens_per_s: float = 91.0
    chars_per_token: float = 4.0  # English text in a Llama-3 tokenizer, about; sets a word's share of the pace

    def __post_init__(self) -> None:
        if not (self.ttft_s >= 0 and self.tokens_per_s > 0 and self.chars_per_token > 0):
            raise ValueError(f"an LLM pace needs ttft_s >= 0 and positive rates, got {self}")

    def tokens_in(self, piece: str) -> int:
        """Tokens a streamed piece of text costs (at least one)."""
        return max(1, math.ceil(len(piece.strip()) / self.chars_per_token))

    def schedule(self, answer: str) -> list[tuple[float, str]]:
        """The answer as (seconds after the request, piece) in streaming order: one piece per word, each sent
        once its last token is generated (the first token at `ttft_s`)."""
        pieces = re.findall(r"\S+\s*", answer)
        at, tokens, out = self.ttft_s, 0, []
        for piece in pieces:
            at = self.ttft_s + (tokens + self.tokens_in(piece) - 1) / self.tokens_per_s
            tokens += self.tokens_in(piece)
            out.append((at, piece))
        return out


def last_user_text(context: LLMContext) -> str:
    """Text of the latest user message in the context ('' if none)."""
    for message in reversed(context.get_messages()):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, str):
                return content
            return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


class OfflineResponder(FrameProcessor):
    """In place of the LLM: each context frame (a finished user turn) gets a canned answer, streamed at `pace`.

    The answer is streamed inside `process_frame`, as Pipecat's LLM services stream theirs, so an interruption
    (which cancels the processor's frame task) stops it where it is.
    """

    def __init__(self, pace: LLMPace | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.pace = pace or LLMPace()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMContextFrame):
            if not frame.speculation:
                await self._respond(reply_to(last_user_text(frame.context)))
        else:
            await self.push_frame(frame, direction)

    async def _respond(self, answer: str) -> None:
        start = time.monotonic()
        await self.push_frame(LLMFullResponseStartFrame())
        for at, piece in self.pace.schedule(answer):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            await self.push_frame(LLMTextFrame(piece))
        await self.push_frame(LLMFullResponseEndFrame())
