"""LiveKit Agents adapter: an Orpheus `tts.TTS` on one process-wide engine shared by every job of a worker.

The worker set-up (`server_options`, `prewarm_engine`, `remote_engine`, `engine_load_fnc`, the `OrpheusPlugin`
registered on import: its `download_files()` fetches the weights) is in livekit/worker.py; the package re-exports
both (`from orpheus_tts_plugin import livekit as orpheus`).
Importing does no GPU work: the engine loads on `prewarm()` or on the first synthesis.

LiveKit's contract (docs/livekit.md, "Timeouts, retries and failover"): `conn_options.timeout` bounds the wait for
each request's first audio and for every later chunk; past it the engine request is aborted and `APITimeoutError`
(retryable) is raised. Engine errors map to LiveKit errors in `_api_error`, whose `retryable` flags decide LiveKit's
retries; `tts.FallbackAdapter` fails over on any of them.

Each stream (one reply in LiveKit's AgentSession) speaks through the reply room (speech/reply.py): its first phrase
(`TTS(first_phrase=N)`), then sentences as the sentence tokenizer cuts them, and its words as `TimedString`s
(`capabilities.aligned_transcript`), seconds from the segment's first sample. LiveKit's preemptive generation
(`preemptive_tts`) runs and cancels syntheses itself: a cancelled one is closed at once, its engine stream aborted.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable

from ..config import EngineConfig, SamplingOverrides
from ..errors import Failure, failure_of, missing_extra
from ..spec import SAMPLE_RATE
from ..speech.first_phrase import FirstPhrase, min_words_of
from ..speech.reply import ReplayText, ReplySpeech, ReplyText, language_voice
from ..speech.words import DEFAULT_WEIGHTS, Pace, Weights
from ..types import SpeechEngine, SpeechOptions
from .worker import _engine_for, prewarm_engine

try:
    from livekit.agents import (
        DEFAULT_API_CONNECT_OPTIONS,
        APIConnectionError,
        APIConnectOptions,
        APIError,
        APIStatusError,
        APITimeoutError,
        tokenize,
        tts,
        utils,
    )
    from livekit.agents.language import LanguageCode
    from livekit.agents.types import NOT_GIVEN, NotGivenOr, TimedString
except ImportError as exc:  # one line saying what to install, not a traceback from deep inside
    raise missing_extra("livekit", "the LiveKit adapter", exc) from exc


logger = logging.getLogger(__name__)

NUM_CHANNELS = 1


def _base(language: LanguageCode | None) -> str | None:
    """A LiveKit language code's base language ("fr-FR" -> "fr"), as the model family names it."""
    return None if language is None else language.language


class TTS(tts.TTS):
    """Orpheus text-to-speech for LiveKit Agents: 24 kHz mono PCM, streamed as the engine decodes it."""

    def __init__(
        self,
        *,
        engine: SpeechEngine | None = None,
        config: EngineConfig | None = None,
        voice: str | None = None,
        language: str | None = None,
        sampling: SamplingOverrides | None = None,
        adapter: str | None = None,
        sentence_tokenizer: NotGivenOr[tokenize.SentenceTokenizer] = NOT_GIVEN,
        word_weights: Weights = DEFAULT_WEIGHTS,
        first_phrase: int | FirstPhrase | None = None,
        **overrides: float | int | None,
    ) -> None:
        """Speak through `engine`, or through the process-wide engine of `config` (the default config if neither).

        `language` (a code such as "fr" or "de-AT", or a `LanguageCode`): the language to speak, one the
        engine's model family speaks (ValueError otherwise); without `voice` it picks that language's default
        voice (docs/voices.md). None: the family's own language. `adapter`: a LoRA adapter of the engine's
        (`EngineConfig.adapters`); None: the voice's own (a fine-tuned voice's, `adapter_voices`), if any.

        Sampling: `sampling` and/or keyword overrides (temperature, top_p, repetition_penalty, max_tokens,
        seed); None uses the engine's default. `sentence_tokenizer` decides where
        `stream()` cuts pushed text into requests (default: LiveKit's blingfire sentence splitter).
        `word_weights`: how the aligned transcript's word times are estimated (docs/word-timestamps.md).
        `first_phrase` (None: off, the default): a minimum number of words (or a `FirstPhrase`); each stream then
        speaks from its first clause mark after that many words instead of its first sentence's end, the rest
        in sentences: the voice starts sooner, the first phrase is intoned without the rest of its sentence.
        """
        if engine is not None and config is not None:
            raise ValueError("pass either engine or config, not both")
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=SAMPLE_RATE,
            num_channels=NUM_CHANNELS,
        )
        self._engine = _engine_for(engine or config)
        # Checked here and at each update_options (TypeError/ValueError now, not mid-call), then passed as they are.
        self._language = self._check_language(language)
        self._voice = voice  # as given (None: the language's default voice)
        self._adapter = adapter  # as given (None: the voice's, if any)
        voice_asked = language_voice(self._engine.spec, _base(self._language), voice)
        self._opts: SpeechOptions = self._engine.check_options(voice_asked, sampling, adapter=adapter, **overrides)
        self._sentence_tokenizer = (
            sentence_tokenizer if utils.is_given(sentence_tokenizer) else tokenize.blingfire.SentenceTokenizer()
        )
        self._streams: weakref.WeakSet[SynthesizeStream] = weakref.WeakSet()
        self._pace = Pace(word_weights)  # the voice's speaking rate, learnt from every sentence this TTS speaks
        self._first_phrase = min_words_of(first_phrase)

    @property
    def engine(self) -> SpeechEngine:
        return self._engine

    @property
    def voice(self) -> str | None:
        return self._opts.voice

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter that speaks: as given, or the fine-tuned voice's; None: the base model."""
        return self._opts.adapter

    @property
    def language(self) -> LanguageCode | None:
        """The language spoken: as set (normalised, e.g. "fr-FR"), or the model family's own; None if not known."""
        return self._language

    @property
    def model(self) -> str:
        return self._engine.config.model or self._engine.config.backend

    @property
    def provider(self) -> str:
        return "orpheus"

    def update_options(
        self,
        *,
        voice: NotGivenOr[str | None] = NOT_GIVEN,
        language: NotGivenOr[str | None] = NOT_GIVEN,
        adapter: NotGivenOr[str | None] = NOT_GIVEN,
        **overrides: NotGivenOr[float | int | None],
    ) -> None:
        """Change options for streams created from now on: voice, language, adapter and sampling fields (None
        restores the default). A new language without a voice keeps the current voice if it speaks that language,
        else takes the language's default voice; a language the model family does not speak is a ValueError."""
        changes = {k: v for k, v in overrides.items() if utils.is_given(v)}
        new_language, new_voice = self._language, voice if utils.is_given(voice) else self._voice
        if utils.is_given(language):
            new_language = self._check_language(language)
            if not utils.is_given(voice) and self._voice is not None and new_language is not None:
                new_voice = language_voice(self._engine.spec, _base(new_language), None, self._voice)
        new_adapter = adapter if utils.is_given(adapter) else self._adapter
        voice_asked = language_voice(self._engine.spec, _base(new_language), new_voice)
        changes.setdefault("speed", self._opts.speed)  # kept unless changed, as the sampling overrides are
        opts = self._engine.check_options(voice_asked, self._opts.overrides, adapter=new_adapter, **changes)
        self._opts, self._voice, self._language, self._adapter = opts, new_voice, new_language, new_adapter

    def _check_language(self, language: str | None) -> LanguageCode | None:
        """`language` normalised (LiveKit's `LanguageCode`), checked against the model family; None: the family's."""
        spec = self._engine.spec
        if language is None:
            return LanguageCode(spec.language) if spec.language else None
        code = LanguageCode(language)
        spec.check_language(code.language)
        return code

    def prewarm(self) -> None:
        """Start loading the engine in the background; never blocks the caller's event loop."""
        prewarm_engine(self._engine)

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        """Close this TTS's open streams; the shared engine keeps serving other jobs."""
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()


async def _speak(reply: ReplySpeech, text: str, emitter: tts.AudioEmitter, timeout: float) -> None:
    """Push the engine's audio for `text` and its timed words into `emitter`, no chunk later than `timeout`.

    Each word is pushed once its estimated end has been generated, before that chunk's audio (seconds from the
    segment's first sample: one reply is one segment); failures become API errors.
    """
    try:
        async for spoken in reply.speak(text, timeout):
            if spoken.words:
                emitter.push_timed_transcript(
                    [TimedString(f"{w.text} ", start_time=w.start_s, end_time=w.end_s) for w in spoken.words]
                )
            if spoken.chunk.pcm:
                emitter.push(spoken.chunk.pcm)
    except Exception as exc:
        raise _api_error(exc, serving=reply.serving) from exc


def _api_error(exc: Exception, *, serving: bool = True) -> APIError:
    """The LiveKit error for a failed request: its class and `retryable` flag decide LiveKit's retries.

    `tts.FallbackAdapter` moves to its next TTS on any error; `retryable` only decides whether this
    TTS is first tried again, `max_retry_per_tts` times, 0.1 s and then `retry_interval` apart.
    `serving`: the engine is not failed or closed (a stream open when a thread died gets a plain
    EngineError; its retry could only meet EngineFailedError).
    """
    kind = failure_of(exc, serving=serving)
    return _API_ERRORS[kind](f"Orpheus synthesis failed: {exc!r}" if kind is Failure.UNEXPECTED else str(exc))


def _not_retryable(message: str) -> APIError:
    return APIError(message, retryable=False)  # this engine will not serve again, or a bug: retrying cannot help


# The LiveKit error for each kind of failure. An overload is not retryable: the engine said it is full, and
# LiveKit's contract does not ask for retries there (tts.py ChunkedStream._main_task retries only `retryable`
# errors; fallback_adapter.py FallbackChunkedStream._run fails over on any exception). Retrying would only delay
# the failover by 2.1 s (max_retry_per_tts=2: 0.1 s + retry_interval 2.0 s) and add load.
_API_ERRORS: dict[Failure, Callable[[str], APIError]] = {
    Failure.TIMEOUT: APITimeoutError,
    Failure.OVERLOADED: lambda message: APIStatusError(message, status_code=503, retryable=False),
    Failure.ENGINE_FAILED: _not_retryable,
    Failure.LOAD_FAILED: _not_retryable,
    Failure.CLOSED: _not_retryable,
    Failure.ENGINE_DOWN: _not_retryable,
    Failure.BAD_INPUT: lambda message: APIStatusError(message, status_code=400, retryable=False),
    Failure.STREAM_FAILED: APIConnectionError,  # one generation failed: worth one more try
    Failure.UNEXPECTED: _not_retryable,
}


def _initialize(emitter: tts.AudioEmitter, *, stream: bool) -> None:
    """Announce 24 kHz mono PCM: one segment per request (`stream=False`) or explicit segments."""
    emitter.initialize(
        request_id=utils.shortuuid(),
        sample_rate=SAMPLE_RATE,
        num_channels=NUM_CHANNELS,
        mime_type="audio/pcm",
        stream=stream,
    )


class ChunkedStream(tts.ChunkedStream):
    """`TTS.synthesize(text)`: the whole text in one engine request (split at sentences by the engine)."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._engine = tts.engine
        self._opts = tts._opts
        self._pace = tts._pace
        self._timeout = conn_options.timeout  # LiveKit keeps conn_options private (tts/tts.py ChunkedStream)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        _initialize(output_emitter, stream=False)
        reply = ReplySpeech(self._engine, self._opts, self._pace)
        await _speak(reply, self.input_text, output_emitter, self._timeout)
        # no flush(): the base class ends the input, so the last audio frame itself carries is_final


class SynthesizeStream(tts.SynthesizeStream):
    """`TTS.stream()`: pushed text is sent to the engine a sentence at a time; one segment per stream."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._engine = tts.engine
        self._opts = tts._opts
        self._sentence_tokenizer = tts._sentence_tokenizer
        self._first_phrase = tts._first_phrase
        self._pace = tts._pace
        self._timeout = conn_options.timeout  # LiveKit keeps conn_options private (tts/tts.py SynthesizeStream)
        self._pushed = ReplayText()

    # LiveKit gives a stream's pushed text to its subclass only through private names (SynthesizeStream._input_ch
    # and _FlushSentinel, tts/tts.py), so the public push_text/flush/end_input also keep it here, for every attempt.
    def push_text(self, token: str) -> None:
        """LiveKit's, keeping the text for `_run`."""
        super().push_text(token)
        self._pushed.add(token)

    def flush(self) -> None:
        """LiveKit's, keeping the flush for `_run`."""
        super().flush()
        self._pushed.add(None)

    def end_input(self) -> None:
        """LiveKit's (it flushes), then no more text for `_run`."""
        super().end_input()
        self._pushed.end()

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        _initialize(output_emitter, stream=True)
        texts: asyncio.Queue[str | None] = asyncio.Queue()
        forward = asyncio.create_task(self._forward_input(texts), name="orpheus.forward_input")
        reply = ReplySpeech(self._engine, self._opts, self._pace)
        try:
            started = False
            while (text := await texts.get()) is not None:
                if not started:
                    output_emitter.start_segment(segment_id=utils.shortuuid())
                    started = True
                self._mark_started()  # LiveKit's only start of the stream's metrics clock (tts/tts.py)
                await _speak(reply, text, output_emitter, self._timeout)
            await forward
            if started:
                output_emitter.end_segment()
        finally:
            await utils.aio.cancel_and_wait(forward)
            await reply.discard()  # aborts whatever is still generating (nothing, once it ended whole)

    async def _forward_input(self, texts: asyncio.Queue[str | None]) -> None:
        """Cut pushed text into what to speak (first phrase, sentences); the first flush after some text ends the
        stream's segment."""
        reply = ReplyText(self._first_phrase, self._sentence_tokenizer.tokenize)
        has_text = False
        async for data in self._pushed.replay():
            if data is None:  # a flush
                if has_text:
                    break  # LiveKit drops text pushed after a segment's flush: nothing more can come
                continue
            for text in reply.feed(data):
                texts.put_nowait(text)
            has_text = True
        for text in reply.finish():
            texts.put_nowait(text)
        texts.put_nowait(None)
