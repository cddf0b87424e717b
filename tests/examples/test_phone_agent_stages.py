"""The phone agent's stages: each configured one checked at start (a refusal is one line), and a stage that fails
mid-call ends the call cleanly (the caller hears an apology, then the agent hangs up; logged once)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import websockets
from loguru import logger
from pipecat.frames.frames import (
    DataFrame,
    EndFrame,
    Frame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from examples.pipecat_phone_agent import mulaw
from examples.pipecat_phone_agent.caller import Line
from examples.pipecat_phone_agent.checks import check_stages
from examples.pipecat_phone_agent.config import parse_args
from examples.pipecat_phone_agent.demo import REPO_ROOT, agent_server, settled_stats
from examples.pipecat_phone_agent.failures import APOLOGY, EndOnStageFailure, MuteWhileEnding
from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService
from tests.adapters.test_pipecat import Recorder
from tests.examples.test_phone_agent import needs_espeak
from tests.stubs import SPEED_IDS, SPEEDS

LLM_MODEL = "test-llm"
REFUSAL_S = 30.0  # a refusal comes before anything loads: seconds, even on this shared machine
CALL_TIMEOUT_S = 60.0
APOLOGY_LOG = "apologising and hanging up"
PLAYOUT_TOLERANCE_S = 0.3  # the agent estimates the caller's playout; the simulated caller models it


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_tts(test_model_dir: Path) -> list[str]:
    """Server flags for Orpheus on the synthetic backend (no model to load: the agent is up in seconds)."""
    return ["--backend", "synthetic", "--model", "none", "--snac", str(test_model_dir / "snac"), "--device", "cpu"]


# ------------------------------------------------------------------ a stand-in LLM server
@dataclass
class FakeLLM:
    """An OpenAI-compatible server that lists `served` and answers every chat request as `chat` says."""

    base_url: str
    chat_requests: list[float]


@contextlib.contextmanager
def fake_llm(chat: str = "error", served: tuple[str, ...] = (LLM_MODEL,)) -> Iterator[FakeLLM]:
    """`chat`: "error" (HTTP 500 at once) or "silent" (never answers: the agent's timeout must end the wait)."""
    release = threading.Event()
    requests: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/").endswith("/models"):
                self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in served]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            requests.append(time.monotonic())
            if chat == "silent":
                release.wait(CALL_TIMEOUT_S)
                return
            self._json(500, {"error": {"message": "the model crashed", "type": "server_error"}})

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            """Quiet: the test reads the agent's log, not this one."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeLLM(f"http://127.0.0.1:{server.server_address[1]}/v1", requests)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# ------------------------------------------------------------------ checks at start
def test_the_offline_defaults_on_the_test_model_pass_every_check(test_model_dir: Path):
    demo_tts = ["--model", str(test_model_dir / "orpheus"), "--snac", str(test_model_dir / "snac"), "--backend", "hf"]
    config = parse_args(["--port", str(closed_port()), *demo_tts, "--device", "cpu"])
    assert (config.stt, config.llm) == ("pocketsphinx", "offline")
    check_stages(config)  # raises on the first stage that cannot run


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A loopback port something listens on for the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@contextlib.contextmanager
def no_context() -> Iterator[None]:
    yield None


@dataclass(frozen=True)
class Refusal:
    """A start that must be refused: the agent's flags (from the test model's folder and what `context` yields)
    and what its one line must say after "phone agent: cannot start: " (a regular expression)."""

    flags: Callable[[Path, Any], list[str]]
    expected: str
    context: Callable[[], contextlib.AbstractContextManager[Any]] = no_context


REFUSALS = {
    "whisper STT not installed": Refusal(lambda d, _: ["--stt", "whisper"], r"^STT \(--stt whisper\): .*pip install"),
    "LLM server down": Refusal(
        lambda d, _: ["--llm", "openai", "--llm-base-url", f"http://127.0.0.1:{closed_port()}/v1"],
        r"^LLM \(.*\): no answer .*--llm-base-url",
    ),
    "LLM without the model": Refusal(
        lambda d, llm: ["--llm", "openai", "--llm-base-url", llm.base_url, "--llm-model", "some-other-model"],
        r"^LLM \(.*\): does not serve 'some-other-model' \(it serves a-model\): pass --llm-model$",
        lambda: fake_llm(served=("a-model",)),
    ),
    "TTS model folder missing": Refusal(
        lambda d, _: ["--backend", "hf", "--model", str(d / "nowhere"), "--snac", str(d / "snac")],
        r"^TTS: .*no such directory",
    ),
    "TTS server down": Refusal(
        lambda d, _: ["--tts-url", f"ws://127.0.0.1:{closed_port()}"],
        r"^TTS: nothing answers at ws://.*start `orpheus-tts serve` there, or drop --tts-url$",
    ),
    "port in use": Refusal(
        lambda d, port: ["--port", str(port)], r"^server: cannot listen on .*pass --port$", listening
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_start_with_a_stage_that_cannot_run_refuses_in_one_line_naming_the_stage_and_the_fix(
    test_model_dir: Path, case: str
):
    if case == "whisper STT not installed" and importlib.util.find_spec("faster_whisper") is not None:
        pytest.skip("faster-whisper is installed here")
    refusal = REFUSALS[case]
    with refusal.context() as given:
        args = ["--port", str(closed_port()), *synthetic_tts(test_model_dir), *refusal.flags(test_model_dir, given)]
        started = time.monotonic()
        cmd = [sys.executable, "-m", "examples.pipecat_phone_agent.server", *args]
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    print(f"{case}: {elapsed:.1f} s: {lines}")
    assert done.returncode == 2 and len(lines) == 1, lines
    prefix = "phone agent: cannot start: "
    assert lines[0].startswith(prefix) and re.search(refusal.expected, lines[0][len(prefix) :]), lines[0]
    assert elapsed < REFUSAL_S


# ------------------------------------------------------------------ a stage failing mid-call
@dataclass
class Fail(DataFrame):
    """Tells `FailingStage` to report a failure, as an STT whose decoder died does."""


class FailingStage(FrameProcessor):
    """Passes every frame on; at each `Fail` it pushes an error, as Pipecat's STT services do (`push_error`)."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, Fail):
            await self.push_error(f"{self}: transcription failed", exception=RuntimeError("the decoder died"))
        else:
            await self.push_frame(frame, direction)


@pytest.fixture(params=list(SPEEDS.values()), ids=SPEED_IDS)
def speed_config(synthetic_config: EngineConfig, request: pytest.FixtureRequest) -> EngineConfig:
    return replace(synthetic_config, synthetic=replace(synthetic_config.synthetic, tokens_per_second=request.param))


def words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


async def test_an_stt_failure_mid_call_is_logged_once_and_the_call_ends_after_the_apology(speed_config):
    engine = OrpheusEngine(speed_config)
    logged: list[str] = []
    sink = logger.add(lambda message: logged.append(str(message)), level="ERROR", format="{message}")
    try:
        stt, llm, tts = FailingStage(), FrameProcessor(), OrpheusTTSService(engine=engine)
        down = Recorder(FrameDirection.DOWNSTREAM)
        worker = PipelineWorker(Pipeline([stt, tts, down]), cancel_on_idle_timeout=False)  # llm: never fails
        EndOnStageFailure("CA-test", stt=stt, llm=llm, tts=tts, mute=MuteWhileEnding()).attach(worker)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        ended = asyncio.create_task(runner.run())
        await down.wait_for(lambda f: isinstance(f, StartFrame), timeout=CALL_TIMEOUT_S)
        await worker.queue_frames([Fail(), Fail()])  # the second failure is not logged again
        await asyncio.wait_for(ended, CALL_TIMEOUT_S)  # the pipeline ends on its own, no cancel
    finally:
        logger.remove(sink)
        await engine.aclose()
    spoken = down.of_type(TTSStartedFrame, TTSAudioRawFrame, TTSTextFrame, TTSStoppedFrame, EndFrame)
    assert isinstance(spoken[0], TTSStartedFrame) and isinstance(spoken[-1], EndFrame)
    assert isinstance(spoken[-2], TTSStoppedFrame) and any(isinstance(f, TTSAudioRawFrame) for f in spoken)
    assert words(" ".join(f.text for f in spoken if isinstance(f, TTSTextFrame))) == words(APOLOGY)
    ours = [line for line in logged if APOLOGY_LOG in line]
    assert len(ours) == 1 and "call CA-test: the STT failed" in ours[0], logged


def speech_played_until(line: Line) -> float:
    """When the caller's playout buffer finished the last agent audio that was not silence."""
    return max(start + len(pcm) / mulaw.RATE for start, pcm in line.heard if pcm.strip(bytes([mulaw.SILENCE])))


async def call_until_the_agent_hangs_up(ws_url: str, question: bytes) -> tuple[Line, float, float]:
    """Greeting, question, then listen until the agent closes the line: the line, when the question's speech
    ended and when the agent hung up."""
    async with websockets.connect(ws_url, max_size=None) as ws:
        line = Line(ws)
        try:
            await line.open()
            await line.first_audio_after(line.t0, CALL_TIMEOUT_S)
            await line.agent_idle(1.5, CALL_TIMEOUT_S)
            _, asked = await line.say(question)
            await line.first_audio_after(asked, CALL_TIMEOUT_S)
            await line.wait(line.agent_hung_up, CALL_TIMEOUT_S, "hang-up by the agent")
            hung_up = line.now()
        finally:
            await line.hang_up()
    return line, asked, hung_up


@needs_espeak
@pytest.mark.parametrize("chat", ["error", "silent"], ids=["the-llm-answers-an-error", "the-llm-never-answers"])
def test_a_mid_call_llm_failure_makes_the_caller_hear_the_apology_and_the_call_end(
    test_model_dir: Path,
    question: bytes,
    tmp_path: Path,
    chat: str,
):
    log = tmp_path / "server.log"
    with fake_llm(chat) as llm:
        server_args = [
            *synthetic_tts(test_model_dir),
            *("--synthetic-rate", "150", "--max-tokens", "300", "--stt", "pocketsphinx"),
            *("--llm", "openai", "--llm-base-url", llm.base_url, "--llm-model", LLM_MODEL, "--llm-timeout", "1"),
        ]
        with agent_server(server_args, log) as base:
            ws_url = base.replace("http://", "ws://") + "/ws"
            line, asked, hung_up = asyncio.run(call_until_the_agent_hangs_up(ws_url, question))
            stats = settled_stats(base)
    text = log.read_text()
    apology_s = line.audio_seconds(asked, float("inf"))
    first = next(a for a, _ in line.media if a > asked)
    played = speech_played_until(line)
    print(
        f"{chat}: {len(llm.chat_requests)} LLM requests; after the caller's speech: apology at {first - asked:.1f} s "
        f"({apology_s:.1f} s with the transport's closing silence, heard until {played - asked:.1f} s), "
        f"hang-up at {hung_up - asked:.1f} s"
    )
    assert llm.chat_requests, "the agent never asked the LLM"
    assert apology_s > 0.5  # the apology, heard
    assert hung_up >= played - PLAYOUT_TOLERANCE_S  # ... to its end: the line closed once the caller had heard it
    assert len([ln for ln in text.splitlines() if APOLOGY_LOG in ln and "the LLM failed" in ln]) == 1, text
    assert f"Generating TTS [{APOLOGY}]" in text  # spoken by the call's Orpheus TTS
    assert "Traceback" not in text
    assert (stats["calls"]["active"], stats["calls"]["total"]) == (0, 1) and stats["engine"]["active_streams"] == 0
