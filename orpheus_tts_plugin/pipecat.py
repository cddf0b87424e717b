"""Pipecat adapter: `OrpheusTTSService` speaks through an in-process `OrpheusEngine` shared by every call.

Contracts with Pipecat 1.14's `TTSService` (services/tts_service.py), each kept in one place below, through
Pipecat's public API only (tests/adapters/test_public_api.py); each workaround names what the API lacks:

- Start-up: `start()` only begins the engine's load (`prewarm()`), so a load never runs inside
  `PipelineWorker`'s start timeout (pipeline/worker.py, `start_timeout_secs`, 20 s by default); synthesis
  waits for the load, `engine_ready` and the `on_engine_ready` event report it, and a failed load is
  reported at once as a permanent error.
- A failed request is reported as one `ErrorFrame` and its context is closed at once, with its turn
  (`on_turn_context_completed`).
- A context stays open while its request runs, so a first chunk later than `stop_frame_timeout_s`
  never splits an utterance (`_keep_context_open`).
- A context whose request failed with a reported error is not counted as a silent one (`push_error`,
  `on_audio_context_completed`): overload is transient, never a dead service.
- Overload: while the engine has no room for a new stream the service is not usable (`is_usable`, the one
  thing `ServiceSwitcherStrategyFailover` reads), reported before an utterance is refused where the load shows
  it (`_check_capacity`), and usable again on its own once the engine has room (`on_usable_changed`).
- Word timestamps (`push_text_frames=False`, `add_word_timestamps`): each word is one `TTSTextFrame` with
  a `pts`, estimated by `words.WordTimer` and placed on the context's playout timeline (`_Playout`), so
  the output transport releases it as its audio plays and an interruption leaves the assistant message
  holding the words spoken.
- Speech from the first phrase (`first_phrase=`): the reply's text goes through `FirstPhraseTextAggregator`
  (a `BaseTextAggregator`, also usable in Pipecat's `LLMTextProcessor`) and reaches the base as
  `AggregatedTextFrame`s, the frames the base speaks as they come; its own sentence aggregator then sees none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from .config import SAMPLING_FIELDS, EngineConfig, SamplingOverrides
from .engine import OrpheusEngine
from .errors import EngineError, EngineFailedError, EngineOverloadedError, Failure, failure_of, missing_extra
from .first_phrase import FirstPhrase, min_words_of
from .pipecat_turns import ReplyHoldFrame, ReplyReleaseFrame
from .reply import ReplyDiscarded, ReplySpeech, ReplyText, language_voice
from .spec import ModelSpec
from .types import AudioChunk, SpeechEngine, SpeechOptions
from .words import DEFAULT_WEIGHTS, Pace, Weights

try:
    from pipecat.audio.utils import create_stream_resampler
    from pipecat.frames.frames import (
        AggregatedTextFrame,
        CancelFrame,
        EndFrame,
        Frame,
        InterruptionFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        StartFrame,
        TTSAudioRawFrame,
        TTSStoppedFrame,
        TTSUpdateSettingsFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, TTSService
    from pipecat.transcriptions.language import Language
    from pipecat.utils.errors import ErrorCategory
    from pipecat.utils.text.base_text_aggregator import Aggregation, BaseTextAggregator

    try:
        from pipecat.utils.text.base_text_aggregator import TextType
    except ImportError:  # pipecat-ai 1.12 names it AggregationType (TextType's deprecated alias in 1.14)
        from pipecat.utils.text.base_text_aggregator import AggregationType as TextType
    from pipecat.utils.tracing.service_decorators import traced_tts
    from pipecat.utils.types import NOT_GIVEN, NotGiven, is_given
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("pipecat", "the Pipecat adapter", exc) from exc


# How each kind of failure is reported: (what the ErrorFrame says, Pipecat category, permanent). Permanent =
# the service is written off (`is_usable` False; a ServiceSwitcher with ServiceSwitcherStrategyFailover moves
# to the next service). An overload is never permanent, but leaves the service unusable until the engine has
# room (`_overloaded`).
_REPORTS: dict[Failure, tuple[str, ErrorCategory, bool]] = {
    Failure.OVERLOADED: ("Orpheus engine overloaded", ErrorCategory.RATE_LIMIT, False),
    Failure.ENGINE_FAILED: ("Orpheus engine failed", ErrorCategory.SERVER, True),
    Failure.LOAD_FAILED: ("Orpheus engine failed to load", ErrorCategory.SERVER, True),
    Failure.CLOSED: ("Orpheus engine closed", ErrorCategory.SERVER, True),
    Failure.BAD_INPUT: ("cannot speak this text with these settings", ErrorCategory.APPLICATION, False),
    Failure.ENGINE_DOWN: ("Orpheus synthesis failed", ErrorCategory.SERVER, True),
    Failure.STREAM_FAILED: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
    Failure.TIMEOUT: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
    Failure.UNEXPECTED: ("Orpheus synthesis failed", ErrorCategory.SERVER, False),
}
_ENGINE_DOWN = ("failed", "closed")  # engine.health() statuses after which nothing more can be spoken
ENGINE_READY = "on_engine_ready"  # this service's own event
# The error TTSService._record_context_audio_outcome pushes for a context that completed with no audio.
_SILENT_CONTEXT = re.compile(r"TTS context (?P<context_id>\S+) completed with no audio")
# TTSService's default `stop_frame_timeout_s`, read from its signature (the base keeps the value private).
_STOP_FRAME_TIMEOUT_S: float = inspect.signature(TTSService.__init__).parameters["stop_frame_timeout_s"].default

logger = logging.getLogger(__name__)


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


class FirstPhraseTextAggregator(BaseTextAggregator):
    """Pipecat's text aggregator for speech from the first phrase: each reply's first phrase at its first clause mark
    after `FirstPhrase.min_words` words, then its sentences (`reply.ReplyText`). A reply ends at `flush()`."""

    def __init__(self, rule: FirstPhrase | int = 3, **kwargs: Any):
        super().__init__(aggregation_type=TextType.SENTENCE, **kwargs)
        self._rule = cast(FirstPhrase, min_words_of(rule))
        self._reply = ReplyText(self._rule)  # the current reply's; a new one at each reply's end

    @property
    def text(self) -> Aggregation:
        return Aggregation(text=self._reply.held, type=TextType.SENTENCE)

    async def aggregate(self, text: str) -> AsyncGenerator[Aggregation, None]:
        for piece in self._reply.feed(text):
            yield Aggregation(text=piece, type=TextType.SENTENCE)

    async def flush(self) -> Aggregation | None:
        """The reply's end: all the text still held, as one aggregation; the next text begins a new reply."""
        text = " ".join(self._reply.finish())
        self._reply = ReplyText(self._rule)
        return Aggregation(text=text, type=TextType.SENTENCE) if text else None

    async def handle_interruption(self) -> None:
        self._reply = ReplyText(self._rule)

    async def reset(self) -> None:
        self._reply = ReplyText(self._rule)


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


class OrpheusTTSService(TTSService):
    """Pipecat TTS service on a shared OrpheusEngine: one service per call, one engine per process.

    Pass `engine=` to share an engine you manage, or `engine_config=` (or nothing) to use the
    process-wide `OrpheusEngine.shared(config)`. The service never closes the engine. `word_weights`:
    how word times are estimated (docs/word-timestamps.md).

    `unusable_while_overloaded` (default True): while the engine has no room for a new stream the service
    reports itself unusable, so that a ServiceSwitcher fails over, and usable again once the engine has room,
    checked every `capacity_poll_s`; False: an overload is only a transient error, as for any provider.

    Event handlers: `on_engine_ready(service)`, once the engine has loaded after this service started;
    Pipecat's `on_usable_changed(service, is_usable)`, also when an overload begins and ends.

    `first_phrase` (None: off, the default): a minimum number of words (or a `FirstPhrase`); each LLM reply is
    then spoken from its first clause mark after that many words instead of its first sentence's end, and the
    rest in sentences (`FirstPhraseTextAggregator`): the voice starts sooner, the first phrase is intoned
    without the rest of its sentence (docs/pipecat.md).

    Keeping a context open while its request runs relies on Pipecat's default `reuse_context_id_within_turn=True`.
    """

    Settings = OrpheusTTSSettings

    def __init__(
        self,
        *,
        engine: SpeechEngine | None = None,
        engine_config: EngineConfig | None = None,
        settings: OrpheusTTSSettings | None = None,
        word_weights: Weights = DEFAULT_WEIGHTS,
        unusable_while_overloaded: bool = True,
        capacity_poll_s: float = 0.1,
        first_phrase: int | FirstPhrase | None = None,
        **kwargs: Any,
    ):
        if engine is not None and engine_config is not None:
            raise ValueError("pass either engine or engine_config, not both")
        rule = min_words_of(first_phrase)
        if rule is not None and kwargs.get("text_aggregation_mode") == TextAggregationMode.TOKEN:
            raise ValueError("first_phrase cuts sentences: it needs text_aggregation_mode SENTENCE, not TOKEN")
        if not capacity_poll_s > 0:
            raise ValueError(f"capacity_poll_s must be > 0, got {capacity_poll_s!r}")
        self._engine = engine or OrpheusEngine.shared(engine_config)
        store = self.Settings(
            model=self._engine.config.model,
            voice=self._engine.spec.default_voice,
            language=_language_of(self._engine.spec),
            adapter=None,
            speed=None,
            **dict.fromkeys(SAMPLING_FIELDS),
        )
        if settings is not None:
            store.apply_update(self._with_language_voice(settings, store))
        self._checked: tuple[tuple[Any, ...], SpeechOptions] | None = None  # (voice, sampling, adapter, speed), options
        self._validate(store)
        self._ready_handlers: list[Callable[..., Any]] = []  # on_engine_ready's
        self._keepalive_s = kwargs.get("stop_frame_timeout_s", _STOP_FRAME_TIMEOUT_S) / 2
        super().__init__(push_start_frame=True, push_stop_frames=True, push_text_frames=False, settings=store, **kwargs)
        self._replies: dict[str, ReplySpeech] = {}  # per audio context (one per turn): its speech, held or not
        self._holding = False  # a reply begun now is held until its turn is confirmed (ReplyHoldFrame)
        self._pace = Pace(word_weights)  # this call's speaking rate, learnt sentence by sentence
        # Contexts given to the engine (run_tts ran for them) -> whether one of their requests failed, reported.
        self._asked_contexts: dict[str, bool] = {}
        self._turns: list[str] = []  # the open turns' contexts, innermost last (a TTSSpeakFrame inside an LLM turn)
        self._last_run_yielded_audio = False  # what the base closes a turn's context on, as it computes it
        self._unusable_while_overloaded = unusable_while_overloaded
        self._capacity_poll_s = capacity_poll_s
        self._overloaded = False  # unusable because the engine is full: usable again once it has room
        self._background: list[asyncio.Task[None]] = []
        # Cleared explicitly per utterance, never by a timer: a slow engine tick must not reset it mid-utterance.
        self._pcm_resampler = create_stream_resampler(clear_after_secs=None)
        # The LLM text's aggregator with first_phrase (None: the base's own); fed on the frame-processing task.
        self._first_phrase_text = None if rule is None else FirstPhraseTextAggregator(rule)

    @property
    def settings(self) -> OrpheusTTSSettings:
        """The current settings (Pipecat's, typed as this service's)."""
        return cast(OrpheusTTSSettings, super().settings)

    @property
    def engine(self) -> SpeechEngine:
        """The engine this service speaks through (possibly shared with other services)."""
        return self._engine

    @property
    def engine_ready(self) -> bool:
        """True once the engine has loaded and serves new streams (False while loading, failed or closed)."""
        return self._engine.ready

    def can_generate_metrics(self) -> bool:
        """TTFB, TTFA and usage metrics are reported."""
        return True

    # ---------------------------------------------------------------- events
    # Pipecat has no public way for a service to declare an event of its own (BaseObject._register_event_handler
    # and _call_event_handler, utils/base_object.py), so `on_engine_ready` keeps its handlers here.
    def add_event_handler(self, event_name: str, handler: Callable[..., Any]) -> None:
        """Pipecat's, plus `on_engine_ready`."""
        if event_name == ENGINE_READY:
            self._ready_handlers.append(handler)
        else:
            super().add_event_handler(event_name, handler)

    def remove_event_handler(self, event_name: str, handler: Callable[..., Any]) -> None:
        """Pipecat's, plus `on_engine_ready`."""
        if event_name == ENGINE_READY:
            self._ready_handlers = [h for h in self._ready_handlers if h is not handler]
        else:
            super().remove_event_handler(event_name, handler)

    async def _engine_ready(self) -> None:
        """Call each `on_engine_ready` handler (sync or async) with this service; one that raises is logged."""
        for handler in list(self._ready_handlers):
            try:
                result = handler(self)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a handler's bug must not stop the others, as in Pipecat's own events
                logger.exception("%s: on_engine_ready handler failed", self)

    # ---------------------------------------------------------------- lifecycle
    async def start(self, frame: StartFrame) -> None:
        """Begin loading the engine and return: the load never counts against the pipeline's start timeout."""
        await super().start(frame)
        try:
            self._engine.prewarm()
        except EngineError as exc:  # a closed engine cannot load again
            await self._report_failure(exc)
            return
        self._background = [self.create_task(self._watch_engine_start(), name="engine_start")]
        if self._unusable_while_overloaded:
            self._background.append(self.create_task(self._watch_capacity(), name="engine_capacity"))

    async def stop(self, frame: EndFrame) -> None:
        """Finish speaking what is queued (the base drains the audio contexts), then stop the helpers."""
        await super().stop(frame)
        await self._stop_background()

    async def cancel(self, frame: CancelFrame) -> None:
        """Abort every engine request of this service at once."""
        await super().cancel(frame)
        await self._stop_background()
        await self._close_all_streams()

    async def cleanup(self) -> None:
        """Abort whatever is still generating; the engine itself stays up for other services."""
        await super().cleanup()
        await self._stop_background()
        await self._close_all_streams()

    async def _watch_engine_start(self) -> None:
        """Report the end of the engine's load: `on_engine_ready`, or at once a permanent error if it failed."""
        try:
            await self._engine.start()
            health = self._engine.health()
            if health["status"] == "failed":  # loaded once, failed since: start() itself succeeds
                raise EngineFailedError(f"engine failed: {health['reason']}")
        except Exception as exc:  # noqa: BLE001 - whatever the load raised, the service cannot speak
            await self._report_failure(exc)
            return
        await self._engine_ready()

    async def _watch_capacity(self) -> None:
        """Check the engine's room every `capacity_poll_s` while the service runs (a property read: no I/O)."""
        while True:
            await self._check_capacity()
            await asyncio.sleep(self._capacity_poll_s)

    async def _check_capacity(self) -> None:
        """Usable again once an overloaded engine has room; unusable as soon as a serving engine has none.

        `engine.load` is the share of `max_streams` in use, so a full engine is reported before it refuses an
        utterance, and a ServiceSwitcher moves the next one to the backup. A service speaking now is left
        alone: its next sentence takes the slot its current one frees. A request queued past
        `queue_timeout_s` behind a full batch does not show in the load: that overload is only seen when a
        request fails, and the service is usable again at the next check.
        """
        full = self._engine.load >= 1
        if self._overloaded and not full:
            self._overloaded = False
            await self.set_usable(True)  # Pipecat's on_usable_changed(service, True): the app may switch back
        elif full and not self._overloaded and self.is_usable and not self._replies and self._engine.ready:
            await self._report_failure(EngineOverloadedError("engine at capacity: no room for a new stream"))

    async def _keep_context_open(self) -> None:
        """Restart the base's quiet-context timer every half `stop_frame_timeout_s` while a request runs.

        The base ends a context that receives nothing for `stop_frame_timeout_s` (3 s by default) and puts
        later audio in a re-created context without a TTSStartedFrame (`append_to_audio_context`). A first
        chunk can come later than that (engine loading, queued behind a full batch); the utterance stays whole.
        """
        # Pipecat's keepalive for an audio context is private (TTSService._refresh_audio_context,
        # services/tts_service.py); the public create_context_id() calls it for the turn's context, the one
        # run_tts is speaking (reuse_context_id_within_turn=True).
        while True:
            await asyncio.sleep(self._keepalive_s)
            self.create_context_id()

    async def _stop_background(self) -> None:
        tasks, self._background = self._background, []
        for task in tasks:
            await self.cancel_task(task)

    # ---------------------------------------------------------------- settings
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

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        """Drop a settings update for this service that the engine would reject (with an error); else the base's,
        with the voice a language change picks added to the update (a new frame: the caller's is left as it is)."""
        if isinstance(frame, TTSUpdateSettingsFrame) and (frame.service is None or frame.service is self):
            given = frame.delta if frame.delta is not None else self.Settings.from_mapping(frame.settings or {})
            delta = await self._accepts(given)
            if delta is None:
                return
            if delta is not given:
                frame = dataclasses.replace(frame, delta=delta, settings={})
        if isinstance(frame, (ReplyHoldFrame, ReplyReleaseFrame, InterruptionFrame)):
            self._holding = isinstance(frame, ReplyHoldFrame)
            if isinstance(frame, ReplyReleaseFrame):
                for reply in self._replies.values():
                    reply.release()
        if self._first_phrase_text is not None and await self._first_phrase_aggregates(frame, direction):
            return
        await super().process_frame(frame, direction)

    async def _first_phrase_aggregates(self, frame: Frame, direction: FrameDirection) -> bool:
        """With first_phrase: aggregate the LLM's text here and hand the base what to speak as AggregatedTextFrames
        (True: `frame` was consumed); drop the held text at an interruption, speak it at the reply's end."""
        aggregator = cast(FirstPhraseTextAggregator, self._first_phrase_text)
        if getattr(frame, "skip_tts", False):
            return False  # the base passes on text that is not to be spoken, as it comes
        if isinstance(frame, LLMTextFrame):
            await self.start_text_aggregation_metrics()
            async for aggregation in aggregator.aggregate(frame.text):
                await self.stop_text_aggregation_metrics()
                await self._speak_aggregation(aggregation, direction)
            return True
        if isinstance(frame, LLMFullResponseStartFrame):
            aggregator.set_language(self.text_aggregation_language)
        elif isinstance(frame, (LLMFullResponseEndFrame, EndFrame)):
            if (remaining := await aggregator.flush()) is not None:
                await self._speak_aggregation(remaining, direction)
        elif isinstance(frame, InterruptionFrame):
            await aggregator.handle_interruption()
        return False

    async def _speak_aggregation(self, aggregation: Aggregation, direction: FrameDirection) -> None:
        """Speak `aggregation` as the base speaks its own aggregator's (as an AggregatedTextFrame it receives)."""
        frame = AggregatedTextFrame(aggregation.text, aggregation.type, raw_text=aggregation.text)
        await super().process_frame(frame, direction)

    async def set_model(self, model: str) -> None:
        """Pipecat's (deprecated), if the engine accepts the model."""
        if await self._accepts(self.Settings(model=model)) is not None:
            await super().set_model(model)

    async def set_voice(self, voice: str) -> None:
        """Pipecat's (deprecated), if the engine accepts the voice."""
        if await self._accepts(self.Settings(voice=voice)) is not None:
            await super().set_voice(voice)

    # ---------------------------------------------------------------- synthesis
    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Stream the engine's audio for `text` as TTSAudioRawFrames at the pipeline's output rate, and its words.

        Each word goes to `add_word_timestamps` once its estimated end has been delivered, timed on the
        context's playout timeline; the base class turns it into a TTSTextFrame with a `pts`. Waits for
        the engine's load if it is still running. A failure is reported at once, and the context is then
        closed with the turn (see `on_turn_context_completed`).
        """
        self._asked_contexts.setdefault(context_id, False)
        self._last_run_yielded_audio = False
        try:
            reply = self._reply_for(context_id, self._options(self.settings))
        except (ValueError, TypeError) as exc:
            await self._report_failure(exc, context_id)
            return
        await self.start_tts_usage_metrics(text)
        await self._pcm_resampler.reset()
        keepalive = self.create_task(self._keep_context_open(), name="context_keepalive")
        try:
            async for spoken in reply.speak(text):
                audio = await self._to_output_rate(spoken.chunk)
                if audio:
                    self._last_run_yielded_audio = True
                    yield TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id)
                if timed := [(w.text, reply.playout.seconds_at(w.start)) for w in spoken.words]:
                    await self.add_word_timestamps(timed, context_id)
        except ReplyDiscarded:
            pass  # the caller went on: nothing of this reply is heard
        except Exception as exc:  # noqa: BLE001 - mapped in _report_failure; a start failure is not an EngineError
            await self._report_failure(exc, context_id)
        finally:
            await self.cancel_task(keepalive)

    def _reply_for(self, context_id: str, options: SpeechOptions) -> ReplySpeech:
        """The context's reply (a new one held while a turn awaits confirmation), speaking with `options` from now."""
        reply = self._replies.get(context_id)
        if reply is None:
            clock = self.get_clock()
            held, seconds = self._holding, lambda: clock.get_time() / 1e9
            reply = ReplySpeech(self._engine, options, self._pace, held=held, clock=seconds)
            self._replies[context_id] = reply
        reply.options = options
        return reply

    async def _to_output_rate(self, chunk: AudioChunk) -> bytes:
        """Resample 24 kHz engine audio to the pipeline's rate, flushing the filter at the utterance's end."""
        if chunk.sample_rate == self.sample_rate:
            return chunk.pcm
        audio = await self._pcm_resampler.resample(chunk.pcm, chunk.sample_rate, self.sample_rate)
        if chunk.final:
            audio += await self._pcm_resampler.flush()
        return audio

    # ---------------------------------------------------------------- failures
    def _classify(self, exc: Exception) -> tuple[str, ErrorCategory, bool]:
        """What a failure means to Pipecat: the ErrorFrame's message, its category, and whether it is permanent."""
        return _REPORTS[failure_of(exc, serving=self._engine.health()["status"] not in _ENGINE_DOWN)]

    async def _report_failure(self, exc: Exception, context_id: str | None = None) -> None:
        """Push one ErrorFrame for `exc` (by `_REPORTS`); its context is not a silent one.

        A permanent failure writes the service off; an overload makes it unusable until the engine has room
        (`_check_capacity` brings it back). Either way `is_usable` is False before the frame travels, which is
        when a ServiceSwitcher's failover strategy reads it.
        """
        what, category, permanent = self._classify(exc)
        overloaded = self._unusable_while_overloaded and isinstance(exc, EngineOverloadedError)
        if overloaded:
            self._overloaded = True
        elif permanent:
            self._overloaded = False  # written off: room in the engine does not bring it back
        if context_id is not None:
            self._asked_contexts[context_id] = True
        await self.cancel_ttfb_metrics()
        await self.push_error(
            f"{self}: {what}: {exc}",
            exception=exc,
            category=category,
            force_treat_as_permanent=permanent or overloaded,
        )
        await self._restart_silence_count()

    # The base's write-off rule (`max_consecutive_zero_audio_contexts`, 3 by default: after that many completed
    # contexts in a row with no audio it pushes a permanent error and the service is no longer given work) is
    # for "a provider that accepts requests and stays silent", whose silence no error surfaces (TTSService.__init__,
    # _record_context_audio_outcome). A request whose failure was reported is no such silence: its own category
    # says whether it is permanent, and counting it would turn three transient overloads into a written-off
    # service. Nor is a context the base never gave to run_tts (it skips a service that is not usable, which may
    # be usable again when the context completes). Contexts the engine was asked to speak that stayed silent
    # without an error are still counted, so the rule keeps catching a wedged engine.
    # Pipecat has no public hook on that count (TTSService._record_context_audio_outcome, services/tts_service.py)
    # and its only public reset is set_usable(True); so the count restarts at each reported failure and after
    # such a context completes, and the per-context "no audio" error pushed for one is dropped (`push_error`).
    def _no_evidence(self, context_id: str) -> bool:
        """True if the context's silence says nothing about the engine: never asked to speak it, or it failed."""
        return self._asked_contexts.get(context_id, True)

    async def _restart_silence_count(self) -> None:
        """Restart the base's count of silent contexts (a no-op for `is_usable` and `on_usable_changed`)."""
        if self.is_usable:
            await self.set_usable(True)  # TTSService.set_usable zeroes the count; the flag is unchanged

    async def push_error(self, error_msg: str, *args: Any, **kwargs: Any) -> None:
        """Pipecat's, less the base's "completed with no audio" error for a context whose silence is no evidence."""
        silent = _SILENT_CONTEXT.fullmatch(error_msg)
        if silent and self._no_evidence(silent["context_id"]):
            return
        await super().push_error(error_msg, *args, **kwargs)

    # ---------------------------------------------------------------- interruption
    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: discard the context's reply (its engine requests aborted, held audio dropped)."""
        self._asked_contexts.pop(context_id, None)
        await self._discard(context_id)

    async def on_audio_context_completed(self, context_id: str) -> None:
        """The context's audio is all out: forget its timeline, and take it out of the silence count if it says
        nothing about the engine (the base restarts word timing with the next)."""
        self._replies.pop(context_id, None)
        if self._no_evidence(context_id):
            await self._restart_silence_count()
        self._asked_contexts.pop(context_id, None)
        await super().on_audio_context_completed(context_id)

    async def on_turn_context_created(self, context_id: str) -> None:
        """Note the turn's context: its end closes it (`on_turn_context_completed`)."""
        self._turns = [*self._turns[-1:], context_id]  # at most an LLM turn and a TTSSpeakFrame inside it
        await super().on_turn_context_created(context_id)

    async def on_turn_context_completed(self) -> None:
        """Close the turn's context at its end even when its last request yielded no audio (it failed at once).

        This service yields all its audio from run_tts, so nothing else will close the context; left open, it
        would hold every later context behind it for `stop_frame_timeout_s`.
        """
        # The base closes it only if the turn's last run_tts yielded audio (the private flag
        # TTSService._is_yielding_frames_synchronously, set in tts_process_generator, services/tts_service.py);
        # this closes it, as the base does, in the other case.
        context_id = self._turns.pop() if self._turns else None
        await super().on_turn_context_completed()
        if context_id is not None and not self._last_run_yielded_audio and self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)

    async def _discard(self, context_id: str) -> None:
        if (reply := self._replies.pop(context_id, None)) is not None:
            await reply.discard()

    async def _close_all_streams(self) -> None:
        for context_id in list(self._replies):
            await self._discard(context_id)
        self._asked_contexts.clear()
