"""The real STT stage: Pipecat's Whisper service (faster-whisper, on the GPU), one model for the whole process."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from pipecat.services.whisper.stt import WhisperSTTService
from pipecat.transcriptions.language import Language

from .config import AgentConfig


class SharedWhisperSTTService(WhisperSTTService):
    """Pipecat's WhisperSTTService, but the model is loaded once per process and shared by every call."""

    _models: ClassVar[dict[tuple[Any, ...], Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def _load(self) -> None:
        key = (self._settings.model, self._device, self._compute_type)
        with self._lock:
            if key not in self._models:
                super()._load()
                self._models[key] = self._model
            self._model = self._models[key]


def make_whisper_stt(config: AgentConfig) -> SharedWhisperSTTService:
    """Whisper on `config.whisper_device`; the first call in the process loads (or downloads) the model."""
    return SharedWhisperSTTService(
        device=config.whisper_device,
        settings=SharedWhisperSTTService.Settings(model=config.whisper_model, language=Language.EN),
    )
