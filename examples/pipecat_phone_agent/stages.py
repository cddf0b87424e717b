"""What every call of the server shares (the Orpheus engine, the recognizer) and the per-call stages built on it."""

from __future__ import annotations

from pipecat.processors.frame_processor import FrameProcessor

from orpheus_tts_plugin import OrpheusEngine
from orpheus_tts_plugin.pipecat import OrpheusTTSService

from .config import AgentConfig
from .offline_responder import OfflineResponder
from .offline_stt import PocketsphinxRecognizer, PocketsphinxSTTService


class AgentResources:
    """Process-wide resources, loaded once at server start and shared by every call."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.engine = OrpheusEngine.shared(config.engine)
        self.recognizer = PocketsphinxRecognizer(config.stt_workers) if config.stt == "pocketsphinx" else None

    async def start(self) -> None:
        """Load the engine (and the offline recognizer) before the first call arrives."""
        await self.engine.start()
        if self.recognizer is not None:
            await self.recognizer.start()

    async def close(self) -> None:
        if self.recognizer is not None:
            self.recognizer.close()
        await self.engine.aclose()

    def make_stt(self) -> FrameProcessor:
        """This call's speech recognizer: pocketsphinx (offline) or Whisper (real)."""
        if self.recognizer is not None:
            return PocketsphinxSTTService(self.recognizer)
        from .whisper_stt import make_whisper_stt

        return make_whisper_stt(self.config)

    def make_llm(self) -> FrameProcessor:
        """This call's responder: the offline responder, or an LLM behind an OpenAI-compatible API (real)."""
        if self.config.llm == "offline":
            return OfflineResponder()
        from .openai_llm import make_openai_llm

        return make_openai_llm(self.config)

    def make_tts(self) -> OrpheusTTSService:
        """This call's voice, speaking through the shared engine."""
        settings = OrpheusTTSService.Settings(voice=self.config.voice, max_tokens=self.config.max_tokens)
        return OrpheusTTSService(engine=self.engine, settings=settings)
