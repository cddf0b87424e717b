"""The `orpheus-tts serve` wire format, in one place: WebSocket messages, the audio frame header, error names.

One WebSocket (`WS_PATH`) carries many streams at once, each named by a stream id the client picks
(uint32, unique among that connection's live streams):

- server → client, first: `hello` (protocol version, model, voices, sampling defaults, max_streams), so
  that the client checks voices and sampling values itself without a round trip, then `status`;
- client → server, first where the server has keys and the client sent no `Authorization` header: `auth` {key}
  (null: it has none, refused at once; a server without keys ignores it);
- client → server: `start` {id, text, voice, sampling, speed, speculative} and `cancel` {id}; `stats` {req} asks
  for the server's counters; `confirm` {id} confirms a speculative stream (its audio will be played), and a
  `cancel` of one that is over but not confirmed discards it (a server whose hello says `speculation` counts
  them; the connection closing discards every one not confirmed);
- server → client: binary audio frames, `HEADER` (stream id, flags, sentence index) then int16 LE
  mono 24 kHz PCM; `UTTERANCE_END` flags a sentence's last frame, and the frame flagged `FINAL` ends
  its stream; `end` {id} ends a stream with no further audio (empty
  text, or the answer to a cancel); `error` {id, error, message} ends a stream with an error whose
  `error` names the exception class to raise (`ERRORS`); `status` {ready, draining, load, ...} when
  the server's readiness or load changes; `stats` {req, stats} answers a stats request.

Every `start` gets exactly one of: a FINAL frame, `end`, or `error`. Imports neither FastAPI nor websockets.
A message of a protocol version other than PROTOCOL_VERSION is refused at the hello.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import Any

from ..config import MAX_TEXT_CHARS, SAMPLING_FIELDS, SamplingOverrides, SamplingParams, check_speed
from ..errors import EngineClosedError, EngineError, EngineFailedError, EngineOverloadedError, ModelLoadError
from ..types import AudioChunk

PROTOCOL_VERSION = 1
WS_PATH = "/v1/stream"
STREAMS_PATH = "/v1/streams"  # one stream per HTTP POST (a `start` body), its messages framed (`frame`)
REPLICA_HEADER = "X-Orpheus-Replica"  # names the replica that answered, on every HTTP response (Ray Serve)
FRAME = struct.Struct("<IB")  # an HTTP stream's message: payload length, kind (FRAME_AUDIO or FRAME_JSON)
FRAME_AUDIO, FRAME_JSON = 0, 1
HEADER = struct.Struct("<IBI")  # stream id, flags, sentence index: 9 bytes before the PCM of every audio frame
FINAL = 0x01  # the stream's last frame
UTTERANCE_END = 0x02  # the last frame of a sentence (AudioChunk.utterance_end)
MAX_STREAM_ID = 2**32 - 1
CLOSE_KEY_REFUSED = 1008  # the WebSocket close code of a missing or wrong API key (policy violation)

# The exception classes that cross the wire by name; anything else arrives as EngineError.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (EngineError, EngineOverloadedError, EngineFailedError, ModelLoadError, ValueError, TypeError)
}


class ProtocolError(ValueError):
    """A message that does not follow this format (the field it names is missing or of the wrong type)."""


# ---------------------------------------------------------------------------------------------- audio frames
def audio_frame(stream_id: int, chunk: AudioChunk) -> bytes:
    """One binary message: the header, then the chunk's PCM."""
    flags = (FINAL if chunk.final else 0) | (UTTERANCE_END if chunk.utterance_end else 0)
    return HEADER.pack(stream_id, flags, chunk.utterance) + chunk.pcm


def audio_stream_id(data: bytes) -> int:
    """The stream id of a binary message."""
    if len(data) < HEADER.size:
        raise ProtocolError(f"audio frame of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
    return HEADER.unpack_from(data)[0]


def parse_audio(data: bytes, start_sample: int) -> AudioChunk:
    """The chunk a binary message carries; `start_sample`: the samples of its stream received before it."""
    _, flags, utterance = HEADER.unpack_from(data)
    final, utterance_end = bool(flags & FINAL), bool(flags & UTTERANCE_END)
    return AudioChunk(data[HEADER.size :], start_sample, final, utterance=utterance, utterance_end=utterance_end)


# ---------------------------------------------------------------------------------------------- JSON messages
def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def parse_json(data: str | bytes) -> Any:
    """JSON text as Python values; ProtocolError for anything that is not JSON, nested past the parser's
    recursion limit included (json raises RecursionError for that)."""
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("not JSON this server parses: nested too deeply") from None


def decode(text: str) -> dict[str, Any]:
    """A text message as a dict with a string `type`; ProtocolError otherwise."""
    message = parse_json(text)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a message must be a JSON object with a string 'type'")
    return message


def stream_id(message: dict[str, Any]) -> int:
    """The message's `id`: an int in [0, 2**32)."""
    sid = message.get("id")
    if not isinstance(sid, int) or isinstance(sid, bool) or not 0 <= sid <= MAX_STREAM_ID:
        raise ProtocolError(f"id must be an int in [0, {MAX_STREAM_ID}], got {sid!r}")
    return sid


@dataclass(frozen=True)
class Start:
    """A request to speak: what `start` carries (and what the HTTP endpoint builds from its JSON body)."""

    text: str
    voice: str | None = None
    sampling: SamplingOverrides = SamplingOverrides()
    adapter: str | None = None  # a LoRA adapter of the server's (hello `adapters`); None: the voice's, if any
    speed: float = 1.0  # the audio's tempo in config.SPEED_RANGE, stretched by the server's engine (pitch kept)
    speculative: bool = False  # spoken before the caller's turn is confirmed: `confirm` or `cancel` settles it

    def message(self, sid: int) -> dict[str, Any]:
        out = {"type": "start", "id": sid, "text": self.text, "voice": self.voice, "sampling": self.sampling.given()}
        if self.adapter is not None:  # absent otherwise: the message a server without adapters knows
            out["adapter"] = self.adapter
        if self.speed != 1.0:  # likewise
            out["speed"] = self.speed
        if self.speculative:  # likewise
            out["speculative"] = True
        return out

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Start:
        """From a `start` message; TypeError naming the field for a wrong type or an unknown sampling option."""
        text, voice, sampling = message.get("text"), message.get("voice"), message.get("sampling") or {}
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if voice is not None and not isinstance(voice, str):
            raise TypeError(f"voice must be a str or null, got {type(voice).__name__}")
        if not isinstance(sampling, dict):
            raise TypeError(f"sampling must be an object, got {type(sampling).__name__}")
        adapter = message.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise TypeError(f"adapter must be a str or null, got {type(adapter).__name__}")
        speculative = message.get("speculative", False)
        if not isinstance(speculative, bool):
            raise TypeError(f"speculative must be a bool, got {type(speculative).__name__}")
        speed = check_speed(message.get("speed", 1.0))
        return cls(text, voice, SamplingOverrides.of(**sampling), adapter, speed, speculative)


def auth(key: str | None) -> dict[str, Any]:
    """The `auth` message: a client's key when it cannot send a header; `None`: it has none (a server with keys then
    refuses at once rather than wait for one; one without keys ignores it)."""
    return {"type": "auth", "key": key}


def cancel(sid: int) -> dict[str, Any]:
    return {"type": "cancel", "id": sid}


def confirm(sid: int) -> dict[str, Any]:
    return {"type": "confirm", "id": sid}


def end(sid: int, cancelled: bool = False) -> dict[str, Any]:
    return {"type": "end", "id": sid, "cancelled": cancelled}


def error(sid: int | None, exc: BaseException) -> dict[str, Any]:
    """The `error` message for `exc`; `sid` None for a connection-level problem (a malformed message)."""
    return {"type": "error", "id": sid, "error": error_name(exc), "message": str(exc)}


def error_name(exc: BaseException) -> str:
    """The wire name of `exc`: its nearest class in ERRORS.

    The server's engine closing means, to a client, that this server went away: it travels as
    EngineError (retry elsewhere), so that a client's EngineClosedError always means its own aclose().
    """
    if isinstance(exc, EngineClosedError):
        return EngineError.__name__
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS and ERRORS[cls.__name__] is cls:
            return cls.__name__
    return EngineError.__name__


def exception(message: dict[str, Any]) -> Exception:
    """The exception an `error` message stands for (EngineError for a name this side does not know)."""
    cls = ERRORS.get(message.get("error"), EngineError)
    return cls(str(message.get("message", "server error")))


# ---------------------------------------------------------------------------------------------- hello
@dataclass(frozen=True)
class Hello:
    """What the server accepts, sent once per connection: enough to check a request without a round trip."""

    model: str | None
    model_family: str
    voices: tuple[str, ...]
    default_voice: str | None
    sampling: SamplingParams
    max_streams: int
    sample_rate: int
    sentence_max_chars: int  # how the server splits text into sentences (AudioChunk.utterance indexes them)
    max_chars: int = MAX_TEXT_CHARS  # characters of text a request may have (absent from older servers: the default)
    protocol: int = PROTOCOL_VERSION
    adapters: tuple[str, ...] = ()  # its LoRA adapters (EngineConfig.adapters); their voices are among `voices`
    replica: str | None = None  # the replica serving this connection, under Ray Serve (None: a lone server)
    # Where to POST each stream instead (STREAMS_PATH), when a proxy in front balances requests but routes a
    # WebSocket once, for its whole life (Ray Serve): None: streams go on this WebSocket.
    streams_path: str | None = None
    speculation: bool = False  # it counts speculative streams (`start` speculative, `confirm`); older servers do not

    def message(self) -> dict[str, Any]:
        out = asdict(self)
        out["voices"] = list(self.voices)
        out["adapters"] = list(self.adapters)
        for optional in ("replica", "streams_path", "speculation"):  # absent when unset: the hello older clients know
            if out[optional] in (None, False):
                del out[optional]
        return {"type": "hello", **out}

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Hello:
        """From a `hello` message; ProtocolError if it is not one, or of another protocol version."""
        if message.get("type") != "hello":
            raise ProtocolError(f"expected hello first, got {message.get('type')!r}")
        if message.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"server speaks protocol {message.get('protocol')!r}, this client {PROTOCOL_VERSION}")
        try:
            sampling = SamplingParams(**{k: message["sampling"][k] for k in SAMPLING_FIELDS}).validate()
            return cls(
                model=message["model"],
                model_family=message["model_family"],
                voices=tuple(message["voices"]),
                default_voice=message["default_voice"],
                sampling=sampling,
                max_streams=int(message["max_streams"]),
                sample_rate=int(message["sample_rate"]),
                sentence_max_chars=int(message["sentence_max_chars"]),
                max_chars=int(message.get("max_chars", MAX_TEXT_CHARS)),
                adapters=tuple(message.get("adapters") or ()),  # absent: a server without adapters
                replica=message.get("replica"),
                streams_path=message.get("streams_path"),
                speculation=bool(message.get("speculation", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed hello: {exc!r}") from None


# ---------------------------------------------------------------------------------------------- HTTP streams
def frame(message: str | bytes) -> bytes:
    """One message of an HTTP stream's body: an audio frame (bytes) or a JSON message (str), length-prefixed."""
    if isinstance(message, str):
        payload = message.encode()
        return FRAME.pack(len(payload), FRAME_JSON) + payload
    return FRAME.pack(len(message), FRAME_AUDIO) + message
