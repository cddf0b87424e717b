"""The real LLM stage: any OpenAI-compatible chat server (vLLM, TensorRT-LLM, llama.cpp, OpenAI itself)."""

from __future__ import annotations

from typing import Any

from pipecat.services.openai.llm import OpenAILLMService

from .config import SYSTEM_PROMPT, AgentConfig

RETRIES = 1  # a request that fails is sent once more (the client's default, 2, keeps a caller waiting ~3 s longer)
# The system prompt asks for one to three short sentences (~20-60 tokens); a reply that runs on past this (~75
# words, half a minute of speech) is cut rather than spoken for minutes. Sent as `max_completion_tokens`.
REPLY_MAX_TOKENS = 100


class TimeLimitedOpenAILLMService(OpenAILLMService):
    """OpenAILLMService whose requests give up after `timeout_s` without an answer, so that the call's failure
    handling apologises within seconds (the OpenAI client waits 10 minutes by default)."""

    def __init__(self, *, timeout_s: float, **kwargs: Any):
        self._timeout_s = timeout_s  # create_client runs inside the base's __init__
        super().__init__(**kwargs)

    def create_client(self, *args: Any, **kwargs: Any) -> Any:
        """The base's client, with the timeout (connect, and each read of the streamed answer) and retries."""
        return super().create_client(*args, **kwargs).with_options(timeout=self._timeout_s, max_retries=RETRIES)


def make_openai_llm(config: AgentConfig) -> OpenAILLMService:
    """The chat model `config.llm_model` at `config.llm_base_url`, told to answer briefly for speech and cut at
    REPLY_MAX_TOKENS."""
    return TimeLimitedOpenAILLMService(
        timeout_s=config.llm_timeout_s,
        api_key=config.llm_api_key,
        base_url=config.llm_base_url,
        settings=OpenAILLMService.Settings(
            model=config.llm_model, system_instruction=SYSTEM_PROMPT, max_completion_tokens=REPLY_MAX_TOKENS
        ),
    )
