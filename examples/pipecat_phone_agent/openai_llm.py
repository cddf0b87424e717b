"""The real LLM stage: any OpenAI-compatible chat server (vLLM, TensorRT-LLM, llama.cpp, OpenAI itself)."""

from __future__ import annotations

from pipecat.services.openai.llm import OpenAILLMService

from .config import SYSTEM_PROMPT, AgentConfig


def make_openai_llm(config: AgentConfig) -> OpenAILLMService:
    """The chat model `config.llm_model` at `config.llm_base_url`, told to answer briefly for speech."""
    return OpenAILLMService(
        api_key=config.llm_api_key,
        base_url=config.llm_base_url,
        settings=OpenAILLMService.Settings(model=config.llm_model, system_instruction=SYSTEM_PROMPT),
    )
