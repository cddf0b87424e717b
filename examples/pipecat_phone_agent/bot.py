"""One phone call: transport in → STT → user aggregator (Silero VAD) → LLM → Orpheus TTS → transport out → assistant."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import WebSocket
from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
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
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

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


def build_worker(websocket: WebSocket, call: TwilioCall, resources: AgentResources) -> PipelineWorker:
    """The call's pipeline, with a greeting on connect and a cancel on hang-up."""
    serializer = TwilioFrameSerializer(
        call.stream_sid,
        call_sid=call.call_sid,
        params=TwilioFrameSerializer.InputParams(auto_hang_up=False),  # the caller hangs up; no Twilio API use
    )
    transport = FastAPIWebsocketTransport(
        websocket,
        FastAPIWebsocketParams(audio_in_enabled=True, audio_out_enabled=True, serializer=serializer),
    )
    aggregators = LLMContextAggregatorPair(
        LLMContext(),
        user_params=LLMUserAggregatorParams(
            vad_analyzer=SileroVADAnalyzer(),
            user_turn_strategies=UserTurnStrategies(stop=[SpeechTimeoutUserTurnStopStrategy()]),
        ),
    )
    pipeline = Pipeline(
        [
            transport.input(),
            resources.make_stt(),
            aggregators.user(),
            resources.make_llm(),
            resources.make_tts(),
            transport.output(),
            aggregators.assistant(),
        ]
    )
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(
            audio_in_sample_rate=PIPELINE_IN_RATE,
            audio_out_sample_rate=PIPELINE_OUT_RATE,
            enable_metrics=True,
            enable_usage_metrics=True,
        ),
    )

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
    await runner.add_workers(build_worker(websocket, call, resources))
    await runner.run()
    logger.info(f"call {call.call_sid} ended")
