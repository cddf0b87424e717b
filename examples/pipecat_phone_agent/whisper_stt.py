"""The real STT stage: Whisper (faster-whisper, on the GPU) on each VAD segment, one model for the whole process.

Built on Pipecat's public `SegmentedSTTService` contract (`run_stt` gets each segment) rather than its
`WhisperSTTService`, which loads a model per service, one per call, with no public way to share one.
"""

from __future__ import annotations

import asyncio
import io
import threading
import wave
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from pipecat.frames.frames import Frame, TranscriptionFrame
from pipecat.services.settings import STTSettings
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.transcriptions.language import Language
from pipecat.utils.time import time_now_iso8601

from .config import AgentConfig

NO_SPEECH_PROB = 0.4  # a piece Whisper finds at least this likely to be no speech is dropped (Pipecat's default)
_models: dict[tuple[str, str, str], Any] = {}  # (model, device, compute type) -> faster-whisper's WhisperModel
_models_lock = threading.Lock()  # guards _models: services are built on any thread


def shared_model(name: str, device: str, compute_type: str = "default") -> Any:
    """This process's faster-whisper model of `name` on `device`, loaded (or downloaded) by its first caller."""
    key = (name, device, compute_type)
    with _models_lock:
        if key not in _models:
            from faster_whisper import WhisperModel

            _models[key] = WhisperModel(name, device=device, compute_type=compute_type)
        return _models[key]


def pcm_samples(segment: bytes) -> np.ndarray:
    """A segment as float32 samples in [-1, 1]: 16-bit PCM, raw or in a WAV container (Pipecat before
    `wants_wav_segments` sends WAV)."""
    if segment[:4] == b"RIFF":
        with wave.open(io.BytesIO(segment)) as wav:
            segment = wav.readframes(wav.getnframes())
    return np.frombuffer(segment, dtype="<i2").astype(np.float32) / 32768.0


class SharedWhisperSTTService(SegmentedSTTService):
    """One transcript per VAD segment from a Whisper model that every call in the process shares.

    Transcripts carry no user id: the phone agent's audio comes from a WebSocket transport, whose frames have none.
    """

    def __init__(self, model: Any, *, model_name: str, language: Language = Language.EN, **kwargs: Any):
        super().__init__(settings=STTSettings(model=model_name, language=language), **kwargs)
        self._whisper = model  # read by worker threads, never replaced
        self._language = language

    @property
    def model(self) -> Any:
        """The shared faster-whisper model this service transcribes with."""
        return self._whisper

    @property
    def wants_wav_segments(self) -> bool:
        """Raw 16-bit PCM: the model reads samples, not files."""
        return False

    def can_generate_metrics(self) -> bool:
        return True

    async def run_stt(self, audio: bytes) -> AsyncGenerator[Frame, None]:
        """Transcribe one segment in a worker thread (faster-whisper decodes as its result is read)."""
        await self.start_processing_metrics()
        text = await asyncio.to_thread(self._transcribe, pcm_samples(audio))
        await self.stop_processing_metrics()
        if text:
            yield TranscriptionFrame(text, "", time_now_iso8601(), self._language)

    def _transcribe(self, samples: np.ndarray) -> str:
        pieces, _info = self._whisper.transcribe(samples, language=str(self._language.value))
        return " ".join(p.text.strip() for p in pieces if p.no_speech_prob < NO_SPEECH_PROB).strip()


def make_whisper_stt(config: AgentConfig) -> SharedWhisperSTTService:
    """Whisper on `config.whisper_device`; the first call in the process loads (or downloads) the model."""
    model = shared_model(config.whisper_model, config.whisper_device)
    return SharedWhisperSTTService(model, model_name=config.whisper_model)
