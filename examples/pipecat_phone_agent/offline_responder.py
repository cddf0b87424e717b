"""The offline responder: stands in for the LLM when the agent runs offline (no model server, no network).

It answers each user turn from a few keyword rules and streams the answer as LLM text frames, so
everything after it (sentence aggregation, Orpheus TTS, interruption) runs exactly as with an LLM.
"""

from __future__ import annotations

import re

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
        ("book", "table", "reserv", "tonight"),
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
    """In place of the LLM: each context frame (a finished user turn) gets a canned, token-streamed answer."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMContextFrame):
            if not frame.speculation:
                await self._respond(reply_to(last_user_text(frame.context)))
        else:
            await self.push_frame(frame, direction)

    async def _respond(self, answer: str) -> None:
        await self.push_frame(LLMFullResponseStartFrame())
        for token in re.findall(r"\S+\s*", answer):
            await self.push_frame(LLMTextFrame(token))
        await self.push_frame(LLMFullResponseEndFrame())
