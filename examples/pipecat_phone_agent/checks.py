"""What the agent checks before it takes calls: its port, and that every configured stage can run.

A stage that cannot run (an STT that is not installed, an LLM server that does not answer, TTS weights that
are not there) would otherwise fail at the first call, with the caller on the line. Each check raises
`StageUnavailable`: one line naming the stage, what is wrong and the fix. The offline stages pass at once.
`check_stages` loads nothing; `start_tts` then loads the engine (or reaches its server), the last check.
Neither imports Pipecat, whose import logs a banner: a refusal is one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from .config import AgentConfig, shared_engine

HTTP_TIMEOUT_S = 3.0  # a local LLM server answers its model list in milliseconds; a dead one never does
WHISPER_MODEL_FILE = "model.bin"  # what a CTranslate2 (faster-whisper) model folder holds


class StageUnavailable(Exception):
    """A stage of the agent cannot run; `str()` is the one line to print: the stage, what is wrong, the fix."""

    def __init__(self, stage: str, why: str):
        super().__init__(f"{stage}: {why}")
        self.stage = stage


def check_stages(config: AgentConfig) -> None:
    """Raise StageUnavailable for the first thing that would stop the agent serving calls; loads nothing."""
    check_port(config.host, config.port)
    check_stt(config)
    check_llm(config)
    check_tts(config)


def check_port(host: str, port: int) -> None:
    """The agent's port is free (uvicorn would find out only after the engine had loaded)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise StageUnavailable("server", f"cannot listen on {host}:{port} ({exc.strerror}): pass --port") from None


def check_stt(config: AgentConfig) -> None:
    """pocketsphinx installed; or faster-whisper installed, its model at hand and its device present."""
    if config.stt == "pocketsphinx":
        _require_module("pocketsphinx", "STT (pocketsphinx)", "pip install pocketsphinx")
        return
    _require_module("faster_whisper", "STT (--stt whisper)", "pip install 'pipecat-ai[whisper]', or --stt pocketsphinx")
    why = _whisper_model_missing(config.whisper_model)
    if why is not None:
        raise StageUnavailable("STT (--stt whisper)", why)
    if config.whisper_device.startswith("cuda"):
        import ctranslate2

        if ctranslate2.get_cuda_device_count() == 0:
            raise StageUnavailable("STT (--stt whisper)", "no CUDA GPU for Whisper here: pass --whisper-device cpu")


def check_llm(config: AgentConfig) -> None:
    """The OpenAI-compatible server answers its model list, accepts the key and serves the model."""
    if config.llm == "offline":
        return
    base = config.llm_base_url.rstrip("/")
    stage = f"LLM ({base})"
    request = urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {config.llm_api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise StageUnavailable(stage, f"the key was refused (HTTP {exc.code}): set OPENAI_API_KEY") from None
        raise StageUnavailable(
            stage, f"GET /models answered HTTP {exc.code}: --llm-base-url must be the API's root (often …/v1)"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise StageUnavailable(
            stage,
            f"no answer ({reason}): start the LLM server (e.g. `vllm serve {config.llm_model} --port 8000`), "
            "point --llm-base-url at it, or pass --llm offline",
        ) from None
    served = _model_ids(body)
    if served and config.llm_model not in served:
        raise StageUnavailable(
            stage, f"does not serve {config.llm_model!r} (it serves {', '.join(served[:5])}): pass --llm-model"
        )


def check_tts(config: AgentConfig) -> None:
    """An `orpheus-tts serve` server answers; or the voice is known and the weights and device an in-process
    engine would load are there (no load)."""
    if config.tts_url:
        urls = [u.strip() for u in config.tts_url.split(",") if u.strip()]
        downs = [why for why in map(_server_down, urls) if why is not None]
        if len(downs) == len(urls):  # one server serving is enough: the others are tried again in the background
            raise StageUnavailable("TTS", f"{'; '.join(downs)}: start `orpheus-tts serve` there, or drop --tts-url")
        return
    from orpheus_tts_plugin.preflight import check_before_load

    try:
        check_before_load(config.engine, config.voice)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:  # ModelLoadError is a RuntimeError
        raise StageUnavailable("TTS", str(exc)) from None


async def start_tts(config: AgentConfig) -> None:
    """Load the process's engine, or connect to its server; StageUnavailable in one line if it cannot serve."""
    engine = shared_engine(config)
    try:
        await engine.start()
    except BaseException as exc:
        await engine.aclose()
        if not isinstance(exc, Exception):  # cancelled, interrupted: not the stage's fault
            raise
        raise StageUnavailable("TTS", first_line(exc)) from None  # the engine's errors say how to get what is missing


def first_line(exc: BaseException) -> str:
    """An exception's message, first line only (a library's message can run to a traceback of its own)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _server_down(url: str) -> str | None:
    """Why nothing answers at the `orpheus-tts serve` URL `url` (ws://, wss://, http(s)://, unix:/PATH), or None."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return None if os.path.exists(parts.path) else f"no socket at {parts.path}"
    port = parts.port or (443 if parts.scheme in ("wss", "https") else 80)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=HTTP_TIMEOUT_S).close()
    except OSError as exc:
        return f"nothing answers at {url} ({exc.strerror or exc})"
    return None


def _require_module(module: str, stage: str, fix: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise StageUnavailable(stage, f"{module} is not installed: {fix}")


def _whisper_model_missing(model: str) -> str | None:
    """Why faster-whisper could not have `model` (a folder, a hub id, or one of its size names), or None."""
    folder = os.path.expanduser(model)
    if os.path.isdir(folder):
        if os.path.isfile(os.path.join(folder, WHISPER_MODEL_FILE)):
            return None
        return f"{model} holds no {WHISPER_MODEL_FILE}: pass a faster-whisper (CTranslate2) model folder"
    if model.startswith(("/", ".", "~")):
        return f"no such folder {model!r}: pass --whisper-model FOLDER or a hub id"
    if "/" not in model:
        from faster_whisper import available_models

        if model in available_models():
            return None
        return f"unknown Whisper model {model!r}: pass a hub id, a folder, or one of {', '.join(available_models())}"
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, WHISPER_MODEL_FILE), str):
        return None
    if not constants.HF_HUB_OFFLINE and _answers(constants.ENDPOINT):
        return None
    return (
        f"{model} is not in the Hugging Face cache and the hub cannot be reached: "
        f"`huggingface-cli download {model}` where there is network, or pass --whisper-model FOLDER"
    )


def _answers(url: str) -> bool:
    """Whether `url` answers HTTP at all (any status) within HTTP_TIMEOUT_S."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _model_ids(body: bytes) -> list[str]:
    """The model ids of an OpenAI `GET /models` answer ([] if it is not one: the model is then not checked)."""
    try:
        listing: Any = json.loads(body)
    except ValueError:
        return []
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
