"""OrpheusTTSService's settings: Pipecat's TTS settings plus Orpheus's sampling, adapter and speed, checked against
the engine before they are taken (a rejected update keeps the current settings, with an error). A mixin of the
service (pipecat/tts.py), on its loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import SAMPLING_FIELDS, SamplingOverrides
from ..errors import missing_extra
from ..spec import ModelSpec
from ..speech.reply import language_voice
from ..types import SpeechOptions

try:
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TTSService
    from pipecat.transcriptions.language import Language
    from pipecat.utils.errors import ErrorCategory
    from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("pipecat", "the Pipecat adapter", exc) from exc


def _delta_field() -> Any:
    """A settings field that is NOT_GIVEN unless set (Pipecat's delta convention)."""
    return field(default_factory=lambda: NOT_GIVEN)


def _language_of(spec: ModelSpec) -> Language | str:
    """The settings' language for an engine's model family: its language (English if the family's is not known)."""
    code = spec.language or "en"
    try:
        return Language(code)
    except ValueError:
        return code


@dataclass
class OrpheusTTSSettings(TTSSettings):
    """Pipecat TTS settings (model, voice, language) plus the Orpheus sampling overrides and LoRA adapter,
    runtime-updatable.

    One field per `SamplingOverrides` field, None meaning the engine's default (tests check the two agree);
    `adapter`: one of the engine's `EngineConfig.adapters`, None: the voice's own (a fine-tuned voice's), if any.
    `speed`: as OpenAI's (and Pipecat's `OpenAITTSService`'s) setting, 0.25 to 4.0.
    """

    adapter: str | None | NotGiven = _delta_field()
    speed: float | None | NotGiven = _delta_field()  # 0.25 to 4.0, the audio stretched with its pitch kept; None: 1.0

    temperature: float | None | NotGiven = _delta_field()
    top_p: float | None | NotGiven = _delta_field()
    repetition_penalty: float | None | NotGiven = _delta_field()
    max_tokens: int | None | NotGiven = _delta_field()
    seed: int | None | NotGiven = _delta_field()


class SettingsChecks(TTSService):
    """The settings half of OrpheusTTSService: the engine's verdict on each change (attributes: its `__init__`)."""

    def _validate(self, settings: OrpheusTTSSettings) -> None:
        """Raise ValueError/TypeError if the engine would reject these settings."""
        if settings.model != self._engine.config.model:
            raise ValueError(
                f"model {settings.model!r} differs from the engine's {self._engine.config.model!r}; "
                "the model is fixed per engine"
            )
        if isinstance(settings.language, str):  # None (no language) and NOT_GIVEN are not checked
            self._engine.spec.check_language(settings.language)
        self._options(settings)

    def _with_language_voice(self, delta: TTSSettings, current: TTSSettings) -> TTSSettings:
        """`delta`, plus the voice for its language when it sets a language and no voice.

        That voice is the current one if it speaks the language, else the language's default voice
        (`ModelSpec.voice_for_language`); a language the engine's model family does not speak is a ValueError.
        """
        if not isinstance(delta.language, str) or is_given(delta.voice):
            return delta
        current_voice = current.voice if isinstance(current.voice, str) else None
        voice = language_voice(self._engine.spec, delta.language, None, current_voice)
        return delta if voice == current_voice else dataclasses.replace(delta, voice=voice)

    def _options(self, settings: OrpheusTTSSettings) -> SpeechOptions:
        """The engine's checked options for `settings`: checked once each time they change, then passed as they are."""
        key = (settings.voice, self._sampling(settings), settings.adapter, settings.speed)
        if self._checked is None or self._checked[0] != key:
            self._checked = (key, self._engine.check_options(key[0], key[1], adapter=key[2], speed=key[3]))
        return self._checked[1]

    @staticmethod
    def _sampling(settings: OrpheusTTSSettings) -> SamplingOverrides:
        """The sampling fields as engine overrides (None means the engine's default)."""
        return SamplingOverrides(**{name: getattr(settings, name) for name in SAMPLING_FIELDS})

    # Pipecat applies every settings update in the private TTSService._update_settings (services/tts_service.py);
    # its public entry points are checked here instead: TTSUpdateSettingsFrame, set_model, set_voice.
    async def _accepts(self, delta: TTSSettings) -> TTSSettings | None:
        """`delta` with the voice its language picks (see `_with_language_voice`) if the engine accepts the settings
        with it applied; otherwise push an error and say None."""
        try:
            delta = self._with_language_voice(delta, self.settings)
            candidate = self.settings.copy()
            candidate.apply_update(delta)
            self._validate(candidate)
        except (ValueError, TypeError) as exc:
            await self.push_error(
                f"{self}: settings update rejected, keeping the current settings: {exc}",
                exception=exc,
                category=ErrorCategory.APPLICATION,
            )
            return None
        return delta

    async def set_model(self, model: str) -> None:
        """Pipecat's (deprecated), if the engine accepts the model."""
        if await self._accepts(self.Settings(model=model)) is not None:
            await super().set_model(model)

    async def set_voice(self, voice: str) -> None:
        """Pipecat's (deprecated), if the engine accepts the voice."""
        if await self._accepts(self.Settings(voice=voice)) is not None:
            await super().set_voice(voice)
