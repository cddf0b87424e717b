"""Phone agent settings: server, stage choices (real or offline), voice, and the shared Orpheus engine."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from orpheus_tts_plugin import EngineConfig, OrpheusEngine, SyntheticConfig
from orpheus_tts_plugin.runtime.affinity import allowed_cpus, cpu_list
from orpheus_tts_plugin.types import SpeechEngine

GREETING = "Hello, thanks for calling. How can I help you today?"
SYSTEM_PROMPT = (
    "You are a friendly receptionist answering the phone. Your replies are spoken aloud, so answer in one "
    "to three short sentences of plain text, with no lists, markdown or emoji."
)
# Calls one agent process carries at once (--max-calls): the knee the demo measured on 2 shared cores (issue 49; the
# agent pinned to one CPU, `orpheus-tts serve` with the CPU test model on the other): 4 calls stayed real time, 6 did
# not (median voice-to-voice 3.4 s, 5 callers cut). A plain number, not one per CPU: a process's calls share its one
# interpreter lock, so a host with more CPUs runs more agent processes (each with its own --max-calls), not more calls
# in one. Measure the knee again for other hosts, stages or engines (the demo with --calls N and --max-calls N).
DEFAULT_MAX_CALLS = 4


@dataclass(frozen=True)
class TurnTaking:
    """When the caller's turn is over: the knobs that set the agent's reaction time (README: measured cost)."""

    vad_start_secs: float = 0.1  # speech this long starts a turn (and interrupts the agent)
    vad_stop_secs: float = 0.2  # silence this long is the end of speech for Silero VAD
    stop: str = "timeout"  # timeout: the turn ends user_speech_timeout after the VAD stop | smart: smart-turn v3
    # Speak ahead: the reply starts at the VAD stop with its audio held, released when `stop` confirms the turn,
    # discarded if the caller goes on (orpheus_tts_plugin.pipecat)
    speak_ahead: bool = True
    user_speech_timeout: float = 0.6  # (timeout) how long the caller may pause and go on before the turn ends
    turn_stop_timeout: float = 5.0  # a turn whose transcript is this late ends without it (Pipecat's default)


@dataclass(frozen=True)
class AgentConfig:
    """Everything one phone agent server needs; every call shares one engine and one STT worker pool."""

    host: str = "127.0.0.1"
    port: int = 8765
    max_calls: int = DEFAULT_MAX_CALLS  # calls carried at once; one more is refused as busy (admission.py)
    public_url: str | None = None  # wss://…/ws that Twilio should connect to; default: from the request's Host
    stt: str = "pocketsphinx"  # pocketsphinx (offline) | whisper (faster-whisper, one model a process)
    stt_workers: int = 2  # pocketsphinx decoder processes
    stt_p99_s: float = 3.0  # (pocketsphinx) how late after the speech end a final transcript may come: the turn waits
    cpus: frozenset[int] | None = None  # run the agent's process on these CPUs only
    stt_cpus: frozenset[int] | None = None  # the recognizers' CPUs (None: the agent's); --cpus: all it had at start
    whisper_model: str = "Systran/faster-distil-whisper-medium.en"
    whisper_device: str = "cuda"
    llm: str = "offline"  # offline (the offline responder) | openai (any OpenAI-compatible server)
    llm_base_url: str = "http://127.0.0.1:8000/v1"
    llm_model: str = "meta-llama/Llama-3.2-3B-Instruct"
    llm_api_key: str = "none"
    llm_timeout_s: float = 10.0  # longest wait for the LLM's answer to begin, or for its next piece
    # (offline) the offline responder's pace: offline_responder.LLMPace says where the defaults come from
    llm_ttft_s: float = 0.042
    llm_tokens_per_s: float = 91.0
    voice: str = "tara"
    max_tokens: int | None = None  # cap on audio tokens per sentence (about 82 per second of speech)
    first_phrase_words: int | None = None  # speak from the reply's first phrase of at least this many words
    greeting: str = GREETING
    turns: TurnTaking = field(default_factory=TurnTaking)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tts_url: str | None = None  # speak through `orpheus-tts serve` at this URL (RemoteEngine) instead of in-process


def shared_engine(config: AgentConfig) -> SpeechEngine:
    """The process's engine for `config`: in process, or a RemoteEngine for an `orpheus-tts serve` URL (one socket)."""
    if config.tts_url:
        from orpheus_tts_plugin import RemoteEngine

        return RemoteEngine.shared(config.tts_url)
    return OrpheusEngine.shared(config.engine)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = AgentConfig()
    e = d.engine
    p = argparse.ArgumentParser(description="Pipecat phone agent (Twilio Media Streams) speaking with Orpheus TTS")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--max-calls", type=positive_int, default=d.max_calls, metavar="N",
        help="calls carried at once; one more is refused as busy (TwiML <Reject>, or its media stream closed)",
    )  # fmt: skip
    p.add_argument("--public-url", default=d.public_url, help="wss:// URL of /ws for the TwiML answer")
    p.add_argument("--stt", choices=("pocketsphinx", "whisper"), default=d.stt)
    p.add_argument("--stt-workers", type=int, default=d.stt_workers, help="pocketsphinx decoder processes")
    p.add_argument(
        "--stt-p99", type=float, default=d.stt_p99_s,
        help="seconds a final transcript may take after the speech ends (pocketsphinx; the turn waits for it)",
    )  # fmt: skip
    p.add_argument(
        "--cpus", type=cpu_list, default=None, metavar="LIST",
        help="run the agent's process on these CPUs only, e.g. 0 (taskset's list); its recognizers run anywhere",
    )  # fmt: skip
    p.add_argument("--whisper-model", default=d.whisper_model)
    p.add_argument("--whisper-device", default=d.whisper_device)
    p.add_argument("--llm", choices=("offline", "openai"), default=d.llm, help="offline: the offline responder")
    p.add_argument("--llm-base-url", default=os.environ.get("LLM_BASE_URL", d.llm_base_url))
    p.add_argument("--llm-model", default=os.environ.get("LLM_MODEL", d.llm_model))
    p.add_argument(
        "--llm-timeout", type=float, default=d.llm_timeout_s, help="seconds without an LLM answer before the call ends"
    )
    p.add_argument(
        "--llm-ttft", type=float, default=d.llm_ttft_s, help="(offline) seconds to the responder's first token"
    )
    p.add_argument(
        "--llm-tokens-per-s", type=float, default=d.llm_tokens_per_s, help="(offline) the responder's tokens/s"
    )
    p.add_argument("--voice", default=d.voice)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="audio tokens per sentence at most")
    p.add_argument(
        "--first-phrase-words", type=int, default=d.first_phrase_words, metavar="N",
        help="start speaking each reply at its first clause mark after N words, not its first sentence's end",
    )  # fmt: skip
    p.add_argument("--greeting", default=d.greeting)
    t = p.add_argument_group("turn taking")
    t.add_argument("--vad-start-secs", type=float, default=d.turns.vad_start_secs)
    t.add_argument("--vad-stop-secs", type=float, default=d.turns.vad_stop_secs)
    t.add_argument(
        "--turn-stop", choices=("timeout", "smart"), default=d.turns.stop,
        help="what confirms the turn: a pause of --user-speech-timeout after the VAD stop, or smart-turn v3",
    )  # fmt: skip
    t.add_argument(
        "--speak-ahead", action=argparse.BooleanOptionalAction, default=d.turns.speak_ahead,
        help="start each reply at the VAD stop, held until the turn is confirmed, dropped if the caller resumes",
    )  # fmt: skip
    t.add_argument("--user-speech-timeout", type=float, default=d.turns.user_speech_timeout)
    t.add_argument(
        "--turn-stop-timeout", type=float, default=d.turns.turn_stop_timeout,
        help="seconds after the speech ends that a turn waits for its transcript (a starved STT: raise it)",
    )  # fmt: skip
    g = p.add_argument_group("Orpheus engine")
    g.add_argument("--tts-url", default=None, help="speak through an `orpheus-tts serve` server (ws://HOST:PORT)")
    g.add_argument("--model", default=e.model, help="hub id or local dir; 'none' with --backend synthetic")
    g.add_argument("--snac", default=e.snac)
    g.add_argument("--backend", default=e.backend, help="hf | trtllm | vllm | remote | synthetic")
    g.add_argument("--device", default=e.device)
    g.add_argument("--max-streams", type=int, default=e.max_streams)
    g.add_argument("--synthetic-rate", type=float, default=0.0, help="synthetic backend: tokens/s per stream")
    return p


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    """AgentConfig from command-line arguments (LLM_BASE_URL, LLM_MODEL, OPENAI_API_KEY from the environment)."""
    a = build_parser().parse_args(argv)
    engine = EngineConfig(
        model=None if a.model in (None, "none") else a.model,
        snac=a.snac,
        backend=a.backend,
        device=a.device,
        max_streams=a.max_streams,
        synthetic=SyntheticConfig(tokens_per_second=a.synthetic_rate),
    )
    return AgentConfig(
        host=a.host,
        port=a.port,
        max_calls=a.max_calls,
        public_url=a.public_url,
        stt=a.stt,
        stt_workers=a.stt_workers,
        stt_p99_s=a.stt_p99,
        cpus=a.cpus,
        stt_cpus=None if a.cpus is None else allowed_cpus(),
        whisper_model=a.whisper_model,
        whisper_device=a.whisper_device,
        llm=a.llm,
        llm_base_url=a.llm_base_url,
        llm_model=a.llm_model,
        llm_api_key=os.environ.get("OPENAI_API_KEY", "none"),
        llm_timeout_s=a.llm_timeout,
        llm_ttft_s=a.llm_ttft,
        llm_tokens_per_s=a.llm_tokens_per_s,
        voice=a.voice,
        max_tokens=a.max_tokens,
        first_phrase_words=a.first_phrase_words,
        greeting=a.greeting,
        turns=TurnTaking(
            a.vad_start_secs, a.vad_stop_secs, a.turn_stop, a.speak_ahead, a.user_speech_timeout, a.turn_stop_timeout
        ),
        engine=engine,
        tts_url=a.tts_url,
    )
