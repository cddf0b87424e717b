"""Pipecat adapter: `OrpheusTTSService` speaks through an in-process `OrpheusEngine` shared by every call.

A translation of Pipecat 1.14's `TTSService` contract (services/tts_service.py) onto the reply room (speech/reply.py),
through Pipecat's public API only (tests/adapters/test_public_api.py); each workaround names what the API lacks.
Its health (readiness, overload, failures: pipecat/health.py) and settings (pipecat/settings.py) are mixins of
their own; speaking ahead of a confirmed turn is pipecat/turns.py's turn strategy and the frames it sends here.

- Start-up: `start()` only begins the engine's load (`prewarm()`), so a load never runs inside `PipelineWorker`'s
  start timeout; synthesis waits for the load, `engine_ready` and `on_engine_ready` report it.
- A context (one turn) is one reply: its texts spoken in order on one timeline, each word one `TTSTextFrame` with
  a `pts` on the reply's playout (`push_text_frames=False`, `add_word_timestamps`), so an interruption leaves the
  assistant message holding the words heard. A context stays open while its request runs (`_keep_context_open`).
- Speaking ahead: after a `ReplyHoldFrame` the next reply's audio is held until a `ReplyReleaseFrame`; an
  interruption (the caller went on) discards it, its engine streams aborted and nothing of it heard or kept.
- Speech from the first phrase (`first_phrase=`): the reply's text goes through `FirstPhraseTextAggregator` (a
  `BaseTextAggregator`) and reaches the base as `AggregatedTextFrame`s, the frames the base speaks as they come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from ..config import SAMPLING_FIELDS, EngineConfig
from ..engine.core import OrpheusEngine
from ..errors import EngineError, missing_extra
from ..speech.first_phrase import FirstPhrase, min_words_of
from ..speech.reply import ReplyDiscarded, ReplySpeech, ReplyText
from ..speech.words import DEFAULT_WEIGHTS, Pace, Weights
from ..types import AudioChunk, SpeechEngine, SpeechOptions
from .health import ServiceHealth
from .settings import OrpheusTTSSettings, SettingsChecks, _language_of
from .turns import ReplyHoldFrame, ReplyReleaseFrame

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
    from pipecat.services.tts_service import TextAggregationMode, TTSService
    from pipecat.utils.text.base_text_aggregator import Aggregation, BaseTextAggregator

    try:
        from pipecat.utils.text.base_text_aggregator import TextType
    except ImportError:  # pipecat-ai 1.12 names it AggregationType (TextType's deprecated alias in 1.14)
        from pipecat.utils.text.base_text_aggregator import AggregationType as TextType
    from pipecat.utils.tracing.service_decorators import traced_tts
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("pipecat", "the Pipecat adapter", exc) from exc


# TTSService's default `stop_frame_timeout_s`, read from its signature (the base keeps the value private).
_STOP_FRAME_TIMEOUT_S: float = inspect.signature(TTSService.__init__).parameters["stop_frame_timeout_s"].default

logger = logging.getLogger(__name__)


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


class OrpheusTTSService(ServiceHealth, SettingsChecks, TTSService):
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
