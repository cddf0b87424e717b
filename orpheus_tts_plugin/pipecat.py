"""Pipecat adapter: `OrpheusTTSService` speaks through an in-process `OrpheusEngine` shared by every call."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import field, fields, make_dataclass
from typing import Any

from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import CancelFrame, Frame, StartFrame, TTSAudioRawFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.tracing.service_decorators import traced_tts
from pipecat.utils.types import NOT_GIVEN

from .config import SAMPLING_FIELDS, EngineConfig, SamplingOverrides
from .engine import AudioChunk, OrpheusEngine
from .errors import EngineClosedError, EngineError, EngineOverloadedError


def _delta_field() -> Any:
    """A settings field that is NOT_GIVEN unless set (Pipecat's delta convention)."""
    return field(default_factory=lambda: NOT_GIVEN)


# Runtime-updatable settings: voice, model, language plus one delta field per SamplingOverrides field
# (None = the engine's default), so that the sampling options are declared in one place only.
OrpheusTTSSettings = make_dataclass(
    "OrpheusTTSSettings",
    [(f.name, f"{f.type} | NotGiven", _delta_field()) for f in fields(SamplingOverrides)],
    bases=(TTSSettings,),
    namespace={"__module__": __name__, "__doc__": "Pipecat TTS settings plus the Orpheus sampling overrides."},
)


class OrpheusTTSService(TTSService):
    """Pipecat TTS service on a shared OrpheusEngine: one service per call, one engine per process.

    Pass `engine=` to share an engine you manage, or `engine_config=` (or nothing) to use the
    process-wide `OrpheusEngine.shared(config)`. The service never closes the engine.
    """

    Settings = OrpheusTTSSettings
    _settings: OrpheusTTSSettings

    def __init__(
        self,
        *,
        engine: OrpheusEngine | None = None,
        engine_config: EngineConfig | None = None,
        settings: OrpheusTTSSettings | None = None,
        **kwargs: Any,
    ):
        if engine is not None and engine_config is not None:
            raise ValueError("pass either engine or engine_config, not both")
        self._engine = engine or OrpheusEngine.shared(engine_config)
        store = self.Settings(
            model=self._engine.config.model,
            voice=self._engine.spec.default_voice,
            language=Language.EN,
            **dict.fromkeys(SAMPLING_FIELDS),
        )
        if settings is not None:
            store.apply_update(settings)
        self._validate(store)
        super().__init__(push_start_frame=True, push_stop_frames=True, settings=store, **kwargs)
        self._streams: dict[str, AsyncGenerator[AudioChunk, None]] = {}
        # Cleared explicitly per utterance, never by a timer: a slow engine tick must not reset it mid-utterance.
        self._pcm_resampler = create_stream_resampler(clear_after_secs=None)

    @property
    def engine(self) -> OrpheusEngine:
        """The engine this service speaks through (possibly shared with other services)."""
        return self._engine

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA and usage metrics are reported."""
        return True

    # ---------------------------------------------------------------- lifecycle
    async def start(self, frame: StartFrame) -> None:
        """Start the (shared) engine once; a failure makes this service unusable."""
        await super().start(frame)
        try:
            await self._engine.start()
        except Exception as exc:  # noqa: BLE001 - any start failure is reported the Pipecat way
            await self.push_error(
                f"{self}: Orpheus engine failed to start: {exc}",
                exception=exc,
                category=ErrorCategory.SERVER,
                force_treat_as_permanent=True,
            )

    async def cancel(self, frame: CancelFrame) -> None:
        """Abort every engine request of this service at once."""
        await super().cancel(frame)
        await self._close_all_streams()

    async def cleanup(self) -> None:
        """Abort whatever is still generating; the engine itself stays up for other services."""
        await super().cleanup()
        await self._close_all_streams()

    # ---------------------------------------------------------------- settings
    def _validate(self, settings: OrpheusTTSSettings) -> None:
        """Raise ValueError/TypeError if the engine would reject these settings."""
        if settings.model != self._engine.config.model:
            raise ValueError(
                f"model {settings.model!r} differs from the engine's {self._engine.config.model!r}; "
                "the model is fixed per engine"
            )
        self._engine.check_options(settings.voice, self._sampling(settings))

    @staticmethod
    def _sampling(settings: OrpheusTTSSettings) -> SamplingOverrides:
        """The sampling fields as engine overrides (None means the engine's default)."""
        return SamplingOverrides(**{name: getattr(settings, name) for name in SAMPLING_FIELDS})

    async def _update_settings(self, delta: OrpheusTTSSettings) -> dict[str, Any]:
        """Apply a delta if the engine accepts it; otherwise push an error and keep the current settings."""
        candidate = self._settings.copy()
        candidate.apply_update(delta)
        try:
            self._validate(candidate)
        except (ValueError, TypeError) as exc:
            await self.push_error(
                f"{self}: settings update rejected, keeping the current settings: {exc}",
                exception=exc,
                category=ErrorCategory.APPLICATION,
            )
            return {}
        return await super()._update_settings(delta)

    # ---------------------------------------------------------------- synthesis
    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Stream the engine's audio for `text` as TTSAudioRawFrames at the pipeline's output rate."""
        settings = self._settings
        try:
            stream = self._engine.synthesize(text, voice=settings.voice, sampling=self._sampling(settings))
        except (ValueError, TypeError) as exc:
            await self.push_error(
                f"{self}: cannot speak {text!r}: {exc}", exception=exc, category=ErrorCategory.APPLICATION
            )
            return
        self._streams[context_id] = stream
        await self.start_tts_usage_metrics(text)
        await self._pcm_resampler.reset()
        try:
            async for chunk in stream:
                audio = await self._to_output_rate(chunk)
                if audio:
                    yield TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)
        except EngineOverloadedError as exc:
            await self._report_failure("Orpheus engine at capacity", exc, ErrorCategory.RATE_LIMIT)
        except EngineClosedError as exc:
            await self._report_failure("Orpheus engine closed", exc, ErrorCategory.SERVER, permanent=True)
        except EngineError as exc:
            await self._report_failure("Orpheus synthesis failed", exc, ErrorCategory.SERVER)
        finally:
            if self._streams.get(context_id) is stream:
                del self._streams[context_id]
            await stream.aclose()

    async def _to_output_rate(self, chunk: AudioChunk) -> bytes:
        """Resample 24 kHz engine audio to the pipeline's rate, flushing the filter at the utterance's end."""
        if chunk.sample_rate == self.sample_rate:
            return chunk.pcm
        audio = await self._pcm_resampler.resample(chunk.pcm, chunk.sample_rate, self.sample_rate)
        if chunk.final:
            audio += await self._pcm_resampler.flush()
        return audio

    async def _report_failure(
        self, what: str, exc: EngineError, category: ErrorCategory, permanent: bool = False
    ) -> None:
        await self.cancel_ttfb_metrics()
        await self.push_error(
            f"{self}: {what}: {exc}", exception=exc, category=category, force_treat_as_permanent=permanent
        )

    # ---------------------------------------------------------------- interruption
    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: abort the engine request still generating this context's audio."""
        await self._close_stream(context_id)

    async def _close_stream(self, context_id: str) -> None:
        stream = self._streams.pop(context_id, None)
        if stream is not None:
            await stream.aclose()

    async def _close_all_streams(self) -> None:
        for context_id in list(self._streams):
            await self._close_stream(context_id)
