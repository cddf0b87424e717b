"""The phone agent with `--llm openai` against a real OpenAI-compatible server: `transformers serve` on 127.0.0.1
with the random-weight test model (its replies are gibberish), through Pipecat's own `OpenAILLMService`.

One call, as cheap as the agent allows: the synthetic TTS on the tiny SNAC, the agent's reply cap
(`openai_llm.REPLY_MAX_TOKENS`) keeping the model's answer short.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from pipecat.services.openai.llm import OpenAILLMService

from examples.pipecat_phone_agent.caller import Line
from examples.pipecat_phone_agent.config import GREETING, parse_args
from examples.pipecat_phone_agent.demo import agent_server, settled_stats
from examples.pipecat_phone_agent.openai_llm import REPLY_MAX_TOKENS, make_openai_llm
from tests.examples.test_phone_agent import needs_espeak
from tests.examples.test_phone_agent_stages import synthetic_tts
from tests.model_dirs import model_with
from tests.servers import transformers_serve

CALL_TIMEOUT_S = 60.0
REPLY_HEARD_S = 1.0  # the caller hangs up once this much of the reply has come: the gibberish is long
# Llama 3's chat format, which the test model's tokenizer (Llama 3's special tokens) lacks a template for.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TTS_REQUEST = re.compile(r"Generating TTS \[(.*)\]$")  # the line Pipecat's TTS service logs per text it speaks


def test_the_agent_s_llm_is_pipecat_s_openai_service_asking_for_a_capped_reply_from_the_configured_model():
    config = parse_args(["--llm", "openai", "--llm-base-url", "http://127.0.0.1:9/v1", "--llm-model", "m"])
    llm = make_openai_llm(config)
    assert isinstance(llm, OpenAILLMService)  # Pipecat's own, so its speculation gate is in the reply's path
    params = llm.build_chat_completion_params({"messages": []})
    assert (params["model"], params["max_completion_tokens"], params["stream"]) == ("m", REPLY_MAX_TOKENS, True)


@pytest.fixture(scope="module")
def chat_model(test_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's test model (its files linked) with a chat template, so that it answers /v1/chat/completions."""
    out = tmp_path_factory.mktemp("chat-model") / "orpheus"
    return model_with(test_model_dir / "orpheus", out, "chat_template.jinja", lambda p: p.write_text(CHAT_TEMPLATE))


@pytest.fixture(scope="module")
def llm_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llm-log") / "serve.log"


@pytest.fixture(scope="module")
def llm_url(chat_model: Path, llm_log: Path) -> Iterator[str]:
    """`transformers serve` with the chat model on a free loopback port; its base URL."""
    with transformers_serve(chat_model, llm_log) as url:
        yield url


async def ask_and_hear_the_reply(ws_url: str, question: bytes) -> tuple[Line, float]:
    """Greeting, question, a second of the reply, hang up: the line and when the question's speech ended."""
    async with websockets.connect(ws_url, max_size=None) as ws:
        line = Line(ws)
        try:
            await line.open()
            await line.first_audio_after(line.t0, CALL_TIMEOUT_S)
            await line.agent_idle(1.0, CALL_TIMEOUT_S)
            _, asked = await line.say(question)
            await line.wait(lambda: line.audio_seconds(asked, line.now()) >= REPLY_HEARD_S, CALL_TIMEOUT_S, "reply")
        finally:
            await line.hang_up()
    return line, asked


@needs_espeak
def test_a_call_with_a_real_openai_compatible_llm_is_answered_with_speech_of_the_llm_s_reply(
    test_model_dir: Path, chat_model: Path, llm_url: str, llm_log: Path, question: bytes, tmp_path: Path
):
    log = tmp_path / "agent.log"
    server_args = [
        *synthetic_tts(test_model_dir),
        *("--synthetic-rate", "150", "--max-tokens", "100", "--stt", "pocketsphinx"),
        *("--llm", "openai", "--llm-base-url", f"{llm_url}/v1", "--llm-model", str(chat_model)),
    ]
    with agent_server(server_args, log) as base:
        line, asked = asyncio.run(ask_and_hear_the_reply(base.replace("http://", "ws://") + "/ws", question))
        stats = settled_stats(base)
    text = log.read_text()
    spoken = [m.group(1) for ln in text.splitlines() if (m := TTS_REQUEST.search(ln))]
    reply = "".join(spoken[1:])
    print(f"reply: {line.audio_seconds(asked, float('inf')):.1f} s of audio for {reply[:80]!r}…")
    assert spoken and spoken[0] == GREETING, spoken
    assert reply and GREETING not in reply and "Sorry" not in reply  # the LLM's own text reached the TTS
    assert line.audio_seconds(asked, float("inf")) > 0.5  # ... and the caller heard it
    errors = re.findall(r".*(?:\| (?:ERROR|CRITICAL) +\||Something went wrong|Traceback).*", text)
    assert not errors, errors  # no error logged, and no ErrorFrame reached the pipeline's worker (its warning)
    assert (stats["calls"]["active"], stats["calls"]["total"]) == (0, 1) and stats["engine"]["active_streams"] == 0
    requests = [ln for ln in llm_log.read_text().splitlines() if "prompt tokens" in ln]
    assert requests and all(f"'max_new_tokens': {REPLY_MAX_TOKENS}" in ln for ln in requests), requests
