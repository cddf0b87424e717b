"""What every call of the server shares (the Orpheus engine, the recognizer) and the per-call stages built on it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pipecat.processors.frame_processor import FrameProcessor

from orpheus_tts_plugin.pipecat import OrpheusTTSService

from .checks import StageUnavailable, first_line
from .config import AgentConfig, shared_engine
from .offline_responder import LLMPace, OfflineResponder
from .offline_stt import PocketsphinxRecognizer, PocketsphinxSTTService


class AgentResources:
    """Process-wide resources, loaded once at server start and shared by every call."""

    KEPT_CALLS = 256  # calls whose latency moments /calls/{stream_sid}/moments still answers

    def __init__(self, config: AgentConfig):
        self.config = config
        self.engine = shared_engine(config)
        self.recognizer = None
        if config.stt == "pocketsphinx":
            self.recognizer = PocketsphinxRecognizer(config.stt_workers, cpus=config.stt_cpus)
        self.moments: OrderedDict[str, list[Any]] = OrderedDict()

    def keep_moments(self, stream_sid: str, moments: list[Any]) -> None:
        """Hold on to a call's latency moments (the list fills as the call goes on), the latest calls only."""
        self.moments[stream_sid] = moments
        while len(self.moments) > self.KEPT_CALLS:
            self.moments.popitem(last=False)

    async def start(self) -> None:
        """Load the engine (at once if `checks.start_tts` did) and the offline recognizer before the first call
        arrives; StageUnavailable in one line if the recognizer cannot start."""
        await self.engine.start()
        if self.recognizer is not None:
            try:
                await self.recognizer.start()
            except Exception as exc:  # noqa: BLE001 - a recognizer that cannot start hears no caller
                raise StageUnavailable("STT (pocketsphinx)", first_line(exc)) from None

    async def close(self) -> None:
        if self.recognizer is not None:
            self.recognizer.close()
        await self.engine.aclose()

    def make_stt(self) -> FrameProcessor:
        """This call's speech recognizer: pocketsphinx (offline) or Whisper (real)."""
        if self.recognizer is not None:
            return PocketsphinxSTTService(self.recognizer, p99_s=self.config.stt_p99_s)
        from .whisper_stt import make_whisper_stt

        return make_whisper_stt(self.config)

    def make_llm(self) -> FrameProcessor:
        """This call's responder: the offline responder, or an LLM behind an OpenAI-compatible API (real)."""
        if self.config.llm == "offline":
            return OfflineResponder(LLMPace(self.config.llm_ttft_s, self.config.llm_tokens_per_s))
        from .openai_llm import make_openai_llm

        return make_openai_llm(self.config)

    def make_tts(self) -> OrpheusTTSService:
        """This call's voice, speaking through the shared engine."""
        settings = OrpheusTTSService.Settings(voice=self.config.voice, max_tokens=self.config.max_tokens)
        return OrpheusTTSService(engine=self.engine, settings=settings, first_phrase=self.config.first_phrase_words)
