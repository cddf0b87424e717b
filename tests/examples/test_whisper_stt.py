"""The phone agent's Whisper stage through a real Pipecat pipeline, on a stand-in for faster-whisper's model (the
real one needs a download and, for speed, a GPU): one transcript per VAD segment, one model per process."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
from pipecat.frames.frames import (
    InputAudioRawFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.tests.utils import run_test

from examples.pipecat_phone_agent import whisper_stt
from examples.pipecat_phone_agent.config import AgentConfig

RATE = 16_000


@dataclass(frozen=True)
class Piece:
    text: str
    no_speech_prob: float


class StandInWhisper:
    """faster-whisper's `WhisperModel` as the stage uses it: `transcribe(samples, language=)` -> (pieces, info)."""

    built = 0

    def __init__(self, name: str, device: str, compute_type: str):
        type(self).built += 1
        self.heard: list[np.ndarray] = []

    def transcribe(self, samples: np.ndarray, *, language: str) -> tuple[list[Piece], None]:
        assert language == "en"
        self.heard.append(samples)
        return [Piece(" Hello there.", 0.1), Piece(" (noise)", 0.9), Piece(" Bye.", 0.2)], None


@pytest.fixture
def whisper(monkeypatch: pytest.MonkeyPatch) -> type[StandInWhisper]:
    monkeypatch.setitem(sys.modules, "faster_whisper", types.SimpleNamespace(WhisperModel=StandInWhisper))
    monkeypatch.setattr(whisper_stt, "_models", {})
    StandInWhisper.built = 0
    return StandInWhisper


def test_every_call_in_the_process_shares_one_model(whisper: type[StandInWhisper]) -> None:
    config = AgentConfig(stt="whisper", whisper_model="tiny.en", whisper_device="cpu")
    a, b = whisper_stt.make_whisper_stt(config), whisper_stt.make_whisper_stt(config)
    assert whisper.built == 1 and a.model is b.model


async def test_a_vad_segment_becomes_one_transcript_of_its_speech_pieces(whisper: type[StandInWhisper]) -> None:
    stt = whisper_stt.make_whisper_stt(AgentConfig(stt="whisper", whisper_model="tiny.en", whisper_device="cpu"))
    tone = (np.sin(np.arange(RATE // 2) / 8) * 8000).astype("<i2").tobytes()  # 0.5 s
    frames = [
        VADUserStartedSpeakingFrame(),
        *[
            InputAudioRawFrame(audio=tone[i : i + 640], sample_rate=RATE, num_channels=1)
            for i in range(0, len(tone), 640)
        ],
        VADUserStoppedSpeakingFrame(),
    ]
    down, _ = await run_test(stt, frames_to_send=frames, start_timeout=60)
    transcripts = [f for f in down if isinstance(f, TranscriptionFrame)]
    assert [t.text for t in transcripts] == ["Hello there. Bye."] and transcripts[0].finalized
    (heard,) = stt.model.heard
    assert heard.dtype == np.float32 and heard.size >= RATE // 2 and np.abs(heard).max() <= 1.0  # PCM, not a WAV


def test_a_wav_segment_reads_as_its_samples() -> None:
    import io
    import wave

    pcm = np.array([0, 16384, -32768], dtype="<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(RATE), wav.writeframes(pcm)
    for segment in (pcm, buffer.getvalue()):
        assert whisper_stt.pcm_samples(segment).tolist() == [0.0, 0.5, -1.0]
