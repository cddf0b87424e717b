"""One phone call: transport in → STT → user aggregator (Silero VAD) → LLM → Orpheus TTS → transport out → assistant."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import WebSocket
from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport
from pipecat.turns.user_stop import (
    BaseUserTurnStopStrategy,
    SpeechTimeoutUserTurnStopStrategy,
    TurnAnalyzerUserTurnStopStrategy,
)
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from orpheus_tts_plugin.pipecat import SpeakAheadUserTurnStopStrategy

from .config import TurnTaking
from .failures import EndOnStageFailure, MuteWhileEnding
from .latency import TurnMoments, call_markers
from .stages import AgentResources

PIPELINE_IN_RATE = 16_000  # what the recognizers (and Silero) take; the serializer upsamples Twilio's 8 kHz
PIPELINE_OUT_RATE = 8_000  # Twilio's rate: OrpheusTTSService resamples its 24 kHz once, the serializer not at all


@dataclass(frozen=True)
class TwilioCall:
    """The identifiers of a Twilio Media Stream, from its `start` message."""

    stream_sid: str
    call_sid: str


async def read_twilio_start(websocket: WebSocket) -> TwilioCall:
    """Read Twilio's opening messages (`connected`, then `start`) and return the stream's identifiers."""
    while True:
        message = json.loads(await websocket.receive_text())
        if message.get("event") == "start":
            start = message["start"]
            return TwilioCall(stream_sid=start["streamSid"], call_sid=start.get("callSid", ""))


def turn_stop_strategy(turns: TurnTaking) -> BaseUserTurnStopStrategy:
    """What ends the caller's turn: a pause of `user_speech_timeout` after the VAD stop, or the smart-turn model;
    with `speak_ahead`, the turn ends at the VAD stop and that verdict releases the reply's held audio."""
    if turns.stop == "smart":
        from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3

        confirm: BaseUserTurnStopStrategy = TurnAnalyzerUserTurnStopStrategy(turn_analyzer=LocalSmartTurnAnalyzerV3())
    else:
        confirm = SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=turns.user_speech_timeout)
    return SpeakAheadUserTurnStopStrategy(confirm) if turns.speak_ahead else confirm


def make_vad(turns: TurnTaking) -> SileroVADAnalyzer:
    """The call's Silero VAD; it loads its model (ONNX) as it is made."""
    return SileroVADAnalyzer(params=VADParams(start_secs=turns.vad_start_secs, stop_secs=turns.vad_stop_secs))


def build_worker(
    websocket: WebSocket, call: TwilioCall, resources: AgentResources, vad: SileroVADAnalyzer
) -> PipelineWorker:
    """The call's pipeline, with a greeting on connect, a cancel on hang-up, and an apology and an end if a stage
    fails (failures.py)."""
    serializer = TwilioFrameSerializer(
        call.stream_sid,
        call_sid=call.call_sid,
        params=TwilioFrameSerializer.InputParams(auto_hang_up=False),  # the caller hangs up; no Twilio API use
    )
    transport = FastAPIWebsocketTransport(
        websocket,
        FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True, serializer=serializer),
    )
    turns = resources.config.turns
    stop = turn_stop_strategy(turns)
    mute = MuteWhileEnding()
    aggregators = LLMContextAggregatorPair(
        LLMContext(),
        user_params=LLMUserAggregatorParams(
            vad_analyzer=vad,
            user_turn_strategies=UserTurnStrategies(stop=[stop]),
            user_mute_strategies=[mute],
            user_turn_stop_timeout=turns.turn_stop_timeout,
        ),
    )
    stt, llm, tts = resources.make_stt(), resources.make_llm(), resources.make_tts()
    user, out = aggregators.user(), transport.output()
    moments = TurnMoments(call_markers(user, stt, llm, tts, out))
    resources.keep_moments(call.stream_sid, moments.moments)

    @tts.event_handler("on_tts_request")
    async def text_to_speak(_tts, _context_id: str, _text: str) -> None:
        moments.note("first_phrase_ready")

    pipeline = Pipeline([transport.input(), stt, user, llm, tts, out, aggregators.assistant()])
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(
            audio_in_sample_rate=PIPELINE_IN_RATE,
            audio_out_sample_rate=PIPELINE_OUT_RATE,
            enable_metrics=True,
            enable_usage_metrics=True,
        ),
        observers=[moments],
    )
    EndOnStageFailure(call.call_sid, stt=stt, llm=llm, tts=tts, mute=mute).attach(worker)

    @transport.event_handler("on_client_connected")
    async def greet(_transport, _websocket) -> None:
        await worker.queue_frame(TTSSpeakFrame(resources.config.greeting))

    @transport.event_handler("on_client_disconnected")
    async def hang_up(_transport, _websocket) -> None:
        await worker.cancel()

    return worker


async def run_call(websocket: WebSocket, call: TwilioCall, resources: AgentResources) -> None:
    """Serve one call until the caller hangs up."""
    logger.info(f"call {call.call_sid} (stream {call.stream_sid}) started")
    runner = WorkerRunner(handle_sigint=False)
    # Off the server's loop: the model's load took 0.1-4 s on 2 loaded cores, and every call's audio and every
    # TwiML answer (a refusal too) waited behind it.
    vad = await asyncio.to_thread(make_vad, resources.config.turns)
    await runner.add_workers(build_worker(websocket, call, resources, vad))
    await runner.run()
    logger.info(f"call {call.call_sid} ended")
