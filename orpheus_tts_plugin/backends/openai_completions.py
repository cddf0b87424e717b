"""The openai-completions backend: an OpenAI-compatible `/v1/completions` server streaming tokens over SSE (aiohttp).

This is how CPU-only agent processes share a pool of GPU servers (trtllm-serve, vLLM, SGLang, `transformers
serve`) behind a load balancer. Prompts go out as token ids where the server accepts them; token ids come back
where the server streams them (trtllm-serve with `detokenize: false`, vLLM with `return_token_ids`), otherwise
they are parsed from the streamed text (`CustomTokenText`), and then mean: `<custom_token_N>` exactly (id = 128256
+ N, the audio), each run of other text between custom tokens one non-audio id (pad) however the server cuts or joins
its events, and special tokens the server skips nothing. One `aiohttp.ClientSession` per backend
(the engine is process-wide, so one per process); closing a stream closes its HTTP response, which makes the
server abort the request. With vLLM, the audio constraint per frame position travels as `vllm_xargs` when the server
runs this package's logits processor (`--logits-processors orpheus_tts_plugin.backends.vllm_logits:...`); otherwise
`allowed_token_ids` (every audio id, any position) if asked, and the engine counts ids at a wrong position.
What has and has not run of it, and against which servers: docs/backends.md.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the openai-completions backend needs aiohttp: pip install 'orpheus-tts-plugin[remote]'") from exc

from ..spec import CODEBOOK_SIZE, ENGLISH, ModelSpec
from .protocol import BackendError, FinishReason, GenerationRequest, check_loop
from .pumped import RequestCounts, continuation

# How each server family wants a completion request: prompt as ids or text, and which non-OpenAI fields it takes
# (trtllm-serve and transformers serve reject unknown fields, so each dialect sends only what its server knows).
DIALECTS = ("vllm", "trtllm", "openai", "transformers")
_RETRY_STATUS = frozenset({502, 503, 504})  # a load balancer with no healthy upstream yet
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
_CUSTOM = re.compile(r"<custom_token_(\d+)>")
_CUSTOM_PREFIX = "<custom_token_"
# `vllm_xargs` keys of OrpheusAudioLogitsProcessor (backends/vllm_logits.py, not imported here: it needs vLLM).
_XARG_ON, _XARG_FIRST, _XARG_EOS = "orpheus_audio", "orpheus_first_audio_token", "orpheus_end_of_speech"
_XARG_OFFSET = "orpheus_audio_offset"  # vllm_logits.OFFSET_ARG: ids generated before a continuation
_PROBE_TOKENS = 7  # one frame: chance that an unconstrained model obeys the probe's ranges ~ (4096 / vocab) ** 7


class CustomTokenText:
    """Streamed text → ids, the same however the server cuts its text into SSE events or joins it.

    `<custom_token_N>` is id base+N, exactly. The text between two custom tokens (or before the first, or after the
    last) is a run; a run with anything but whitespace in it becomes ONE `other` id (a non-audio id such as pad),
    emitted as soon as its first non-blank character arrives (no added latency), so the frame parser counts it as
    invalid instead of silently losing it; a blank run (whitespace a detokeniser puts between tokens) is no id.
    Whitespace inside a run does not end it: only a custom token does. The ids are thus a function of the stream's
    whole text, not of its events: a server that sends each token's text as its own event and one that joins
    several into one (`transformers serve` does when its writer falls behind) give the same ids, where one id per
    event made their number depend on the server's timing. Special tokens the server skips are not in the text,
    so they give no id and do not end a run.

    A chunk may end inside a token name (`<custom_tok`); that tail waits for the next chunk, and `flush()` at the
    end of the stream counts it as text of the last run.
    """

    def __init__(self, base: int, other: int):
        self.base = base
        self.other = other
        self._tail = ""
        self._in_run = False  # the current run's `other` id is out: more text of it is no id

    def feed(self, text: str) -> list[int]:
        s = self._tail + text
        self._tail = ""
        cut = s.rfind("<")
        if cut != -1 and _is_partial(s[cut:]):
            s, self._tail = s[:cut], s[cut:]
        ids: list[int] = []
        pos = 0
        for m in _CUSTOM.finditer(s):
            self._run_text(s[pos : m.start()], ids)
            ids.append(self.base + int(m.group(1)))
            self._in_run = False
            pos = m.end()
        self._run_text(s[pos:], ids)
        return ids

    def flush(self) -> list[int]:
        """Ids of a leftover partial tail at the end of the stream (it was not a token: text of the last run)."""
        tail, self._tail = self._tail, ""
        ids: list[int] = []
        self._run_text(tail, ids)
        return ids

    def drop_tail(self) -> None:
        """Forget a partial token name: its response was closed (a pause), and a continuation starts anew. The
        run goes on: text that the continuation streams before its first custom token is no new id."""
        self._tail = ""

    def _run_text(self, text: str, ids: list[int]) -> None:
        """Text between custom tokens: the run's one `other` id if this is its first non-blank text."""
        if not self._in_run and text.strip():
            ids.append(self.other)
            self._in_run = True


def _is_partial(fragment: str) -> bool:
    """True if `fragment` could still grow into `<custom_token_N>`."""
    if len(fragment) <= len(_CUSTOM_PREFIX):
        return _CUSTOM_PREFIX.startswith(fragment)
    return fragment.startswith(_CUSTOM_PREFIX) and fragment[len(_CUSTOM_PREFIX) :].isdigit()


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class OpenAICompletionsBackend:
    """Token generation on a remote OpenAI-compatible completions server."""

    name = "openai-completions"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        dialect: str = "vllm",
        spec: ModelSpec = ENGLISH,
        tokenizer: Any = None,
        api_key: str | None = None,
        constrain_audio: bool | None = None,
        audio_processor: bool | None = None,
        connect_retries: int = 3,
        retry_backoff_s: float = 0.2,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_connections: int = 1024,
        extra_body: dict[str, Any] | None = None,
    ):
        if dialect not in DIALECTS:
            raise ValueError(f"unknown openai-completions dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
        if dialect == "transformers" and tokenizer is None:
            raise ValueError("the 'transformers' dialect sends text prompts and needs `tokenizer` (path, id or object)")
        if connect_retries < 0 or retry_backoff_s < 0:
            raise ValueError("connect_retries and retry_backoff_s must be >= 0")
        self.url = _base_url(url)
        self.endpoint = f"{self.url}/v1/completions"
        self.model = model
        self.dialect = dialect
        self.spec = spec
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.constrain_audio = constrain_audio
        self.audio_processor = audio_processor if dialect == "vllm" else False
        self.connect_retries = connect_retries
        self.retry_backoff_s = retry_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.extra_body = dict(extra_body or {})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._allowed_json = json.dumps(spec.audio_ids)
        self._requests = RequestCounts("retries", pausable=True)

    async def start(self) -> None:
        if self._session is not None:
            return
        self._loop = asyncio.get_running_loop()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
            ),
            headers=headers,
        )
        if self.dialect == "transformers" and isinstance(self.tokenizer, str):
            from transformers import AutoTokenizer

            self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.tokenizer)
        if self.model is None:
            self.model = await self._first_model()
        if self.audio_processor is None and self.constrain_audio is not False:
            self.audio_processor = await self._probe_audio_processor()

    @property
    def audio_constraint(self) -> str:
        """How constrained requests are restricted: "position" (vllm_xargs), "allowed_ids" (any audio id) or "none"."""
        if self.dialect != "vllm" or self.constrain_audio is False:
            return "none"
        if self.audio_processor:
            return "position"
        return "allowed_ids" if self.constrain_audio else "none"

    async def _probe_audio_processor(self) -> bool:
        """True if the server applies OrpheusAudioLogitsProcessor: a greedy probe with shifted ids obeys them."""
        body = {
            "model": self.model,
            "prompt": [self.spec.bos],
            "max_tokens": _PROBE_TOKENS,
            "stream": False,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            # Frame ids moved to the start of the vocabulary: only the processor makes a model emit exactly these.
            "vllm_xargs": {_XARG_ON: 1, _XARG_FIRST: 0, _XARG_EOS: 0},
        }
        try:
            async with self._session.post(self.endpoint, json=body) as resp:
                if resp.status != 200:
                    return False
                ids = (await resp.json())["choices"][0]["token_ids"]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return False
        return len(ids) == _PROBE_TOKENS and all(
            k * CODEBOOK_SIZE <= t < (k + 1) * CODEBOOK_SIZE for k, t in enumerate(ids)
        )

    async def _first_model(self) -> str:
        """The first model id the server lists (GET /v1/models), retried like requests."""
        err: BaseException | None = None
        for attempt in range(self.connect_retries + 1):
            try:
                async with self._session.get(f"{self.url}/v1/models") as resp:
                    if resp.status == 200:
                        return (await resp.json())["data"][0]["id"]
                    err = BackendError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                    if resp.status not in _RETRY_STATUS:
                        break
            except aiohttp.ClientConnectionError as exc:
                err = exc
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise BackendError(f"{self.url}/v1/models lists no model; pass model=...") from exc
            await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise BackendError(f"cannot list models at {self.url}/v1/models: {err}")

    def request_body(self, req: GenerationRequest, audio_offset: int = 0) -> str:
        """The JSON body of one streaming completion request in this backend's dialect (`audio_offset`: ids
        its stream generated before it, a continuation after a pause, so the constraint goes on in frame)."""
        s = req.sampling
        stop = list(self.spec.stop_ids(req.stop_ids))
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_new_tokens,
            "stream": True,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if self.dialect == "transformers":
            body["prompt"] = self.tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False)
            gen = {
                "do_sample": s.temperature > 0,
                "repetition_penalty": s.repetition_penalty,
                "eos_token_id": stop,
                "pad_token_id": self.spec.pad,
                "bos_token_id": self.spec.bos,
            }
            if s.temperature > 0:
                gen.update(temperature=s.temperature, top_p=s.top_p)
            body["generation_config"] = json.dumps(gen)
        else:
            body["prompt"] = list(req.prompt_ids)
        if self.dialect in ("vllm", "trtllm"):
            body.update(repetition_penalty=s.repetition_penalty, stop_token_ids=stop, skip_special_tokens=False)
        if self.dialect == "vllm":
            body["return_token_ids"] = True
        elif self.dialect == "trtllm":
            body["detokenize"] = False
        constraint = self.audio_constraint if req.constrain_audio else "none"
        if constraint == "position":
            body["vllm_xargs"] = {
                _XARG_ON: 1,
                _XARG_FIRST: self.spec.first_audio_token,
                _XARG_EOS: self.spec.end_of_speech,
            }
            if audio_offset:
                body["vllm_xargs"][_XARG_OFFSET] = audio_offset
        body.update(self.extra_body)
        text = json.dumps(body)
        if constraint == "allowed_ids":
            text = f'{text[:-1]}, "allowed_token_ids": {self._allowed_json}}}'
        return text

    def generate(self, req: GenerationRequest) -> CompletionsStream:
        check_loop(self._loop if self._session is not None else None, self.name)
        self._requests.started()
        return CompletionsStream(self._session, self, req, self._requests)

    def stats(self) -> dict[str, Any]:
        return self._requests.stats(self.name, url=self.url, audio_constraint=self.audio_constraint)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class CompletionsStream:
    """New ids of one remote request, one SSE event at a time; `aclose()` closes the HTTP response.

    Pausing (the engine's reader is behind): a completions server has no per-request pause, so `pause(True)`
    closes the response, which aborts the request there (its row and KV blocks freed), and after `pause(False)`
    the next read sends its `continuation`: prompt + every id delivered, the rest of the budget, the audio
    constraint going on at the next frame position, request id `{id}~{n}`. The reader sees one request. Call
    `pause` between reads (the engine does: from the task that reads).

    From a text server, "every id delivered" is what `CustomTokenText` made of the text: the audio exactly, each
    run of other text one pad, a skipped special token nothing. So the continuation's prompt has a pad where a
    run of text was (text the frame parser discards anyway), and its budget, `max_new_tokens` less the ids
    delivered, is at least what was left of it (a run is one token or more, an audio id exactly one): a pause
    never shortens a stream, and one with text among its audio may generate a few tokens more than
    `max_new_tokens` in all. A run that the pause cut goes on in the continuation: the continuation's text before
    its first custom token is no new id, as if there had been no pause.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        backend: OpenAICompletionsBackend,
        req: GenerationRequest,
        counts: RequestCounts,
    ):
        self.req = req
        self.finish_reason: str | None = None
        self._session = session
        self._backend = backend  # read only: its request settings
        self._counts = counts
        self._resp: aiohttp.ClientResponse | None = None
        self._stop = frozenset(backend.spec.stop_ids(req.stop_ids))
        self._text = CustomTokenText(backend.spec.custom_token_base, backend.spec.pad)
        self._ended = False  # no more ids: finish seen, failed or closed
        self._drain_pending = False
        self.attempt = req  # the request sent (or to send): `req` or its latest continuation
        self._sent: list[int] = []  # every id delivered, all attempts: a continuation's prompt tail (text: a pad a run)
        self._paused = False
        self._resumes = 0

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) generating, as the class docstring says; nothing once ended or unchanged."""
        if self._ended or paused == self._paused:
            return
        self._paused = paused
        if not paused:
            self._counts.resume()
            if len(self._sent) >= self.req.max_new_tokens:  # the budget ran out just as the pause came
                self._end(FinishReason.LENGTH)
                return
            self._resumes += 1
            self.attempt = continuation(self.req, self._sent, self._resumes)
            self._text.drop_tail()  # the closed response's partial token name; its run goes on
            return
        self._counts.pause()
        if self._resp is not None:
            self._resp.close()  # the server sees the disconnect and aborts the request
            self._resp = None

    def __aiter__(self) -> CompletionsStream:
        return self

    async def __anext__(self) -> list[int]:
        if self._paused:
            raise BackendError("openai-completions backend: read while paused")
        if self._resp is None and not self._ended:
            await self._open()
        while not self._ended:
            data = await self._next_event()
            if self._ended:  # closed by aclose() while reading
                break
            if data is None:
                self._fail("the server ended the stream without a finish reason")
            if "error" in data:
                self._fail(f"the server reported an error: {str(data['error'])[:500]}")
            choices = data.get("choices") or ()
            if not choices:
                continue  # e.g. a usage-only chunk
            choice = choices[0]
            token_ids = choice.get("token_ids")
            ids = list(token_ids) if token_ids is not None else self._text.feed(choice.get("text") or "")
            reason = choice.get("finish_reason")
            if reason is not None:
                if token_ids is None:
                    ids += self._text.flush()
                self._end(_FINISH.get(reason, FinishReason.ERROR))
                self._drain_pending = True
            ids = [i for i in ids if i not in self._stop]
            if ids:
                self._counts.add_tokens(len(ids))
                self._sent += ids
                return ids
        if self._drain_pending:
            self._drain_pending = False
            await self._drain()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Close the HTTP response: a server still generating sees the disconnect and aborts the request."""
        if not self._ended:
            self._end(FinishReason.ABORTED, paused=self._paused)
        if self._resp is not None and (self._drain_pending or self.finish_reason == FinishReason.ABORTED):
            self._resp.close()  # aborted, or finished with the body's tail unread: the connection is not reused
        self._drain_pending = False

    async def _open(self) -> None:
        """POST the request; connection failures before any response are retried with exponential backoff."""
        b = self._backend
        body = b.request_body(self.attempt, audio_offset=len(self._sent))
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        err: BaseException | None = None
        for attempt in range(b.connect_retries + 1):
            if attempt:
                self._counts.counts["retries"] += 1
                await asyncio.sleep(b.retry_backoff_s * 2 ** (attempt - 1))
            if self._ended:  # closed while retrying
                raise StopAsyncIteration
            try:
                resp = await self._session.post(b.endpoint, data=body, headers=headers)
            except aiohttp.ClientConnectionError as exc:
                err = exc
                continue
            if resp.status == 200:
                if self._ended:  # closed while connecting
                    resp.close()
                    raise StopAsyncIteration
                self._resp = resp
                return
            detail = (await resp.text())[:500]
            resp.release()
            err = BackendError(f"HTTP {resp.status} from {b.endpoint}: {detail}")
            if resp.status not in _RETRY_STATUS:
                break
        self._fail(f"request {self.attempt.request_id} to {b.endpoint} failed after {attempt + 1} attempt(s): {err}")

    async def _next_event(self) -> dict[str, Any] | None:
        """The next SSE `data:` payload as JSON; None at the end of the stream (EOF or `[DONE]`).

        A stream cut in the middle of an event is a BackendError, never a short stream or half an event: aiohttp
        raises ClientPayloadError where the body's framing (chunked, Content-Length) says it is incomplete, and
        where the body ends cleanly in the middle of a line (a server or proxy that closed it there, a body
        delimited by the connection's end), readline returns that partial line: an error too, even if its JSON
        happens to be whole.
        """
        content = self._resp.content
        while True:
            try:
                line = await content.readline()
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: line too long
                if self._ended:  # closed by aclose() while reading
                    raise StopAsyncIteration from None
                self._fail(f"stream broken: {exc!r}")
            if not line:
                return None
            if not line.endswith(b"\n"):
                if self._ended:  # closed by aclose() while reading
                    raise StopAsyncIteration
                self._fail(f"stream cut in the middle of a line: {line[:200]!r}")
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return None
            try:
                return json.loads(payload)
            except ValueError:
                self._fail(f"unparseable SSE data: {payload[:200]!r}")

    async def _drain(self) -> None:
        """Read what follows the finish chunk (usage, `[DONE]`) so the connection can be reused; bounded."""
        try:
            await asyncio.wait_for(self._resp.read(), 1.0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self._resp.close()
        else:
            self._resp.release()

    def _end(self, reason: str, paused: bool = False) -> None:
        self._ended = True
        self.finish_reason = reason
        self._counts.ended(reason, paused=paused)

    def _fail(self, message: str) -> None:
        if not self._ended:
            self._end(FinishReason.ERROR)
        if self._resp is not None:
            self._resp.close()
        raise BackendError(f"openai-completions backend: {message}")
