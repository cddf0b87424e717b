"""Simulated caller: speaks the Twilio Media Streams protocol over a real WebSocket, like Twilio does for a call.

It streams 8 kHz μ-law in 20 ms media messages in real time (silence between utterances), plays the
agent's audio through a model of Twilio's playout buffer (a `clear` drops what is not yet played),
records both sides to a stereo WAV (left: caller, right: agent as heard), and measures:

- greeting: WebSocket open → first agent audio;
- each turn: end of the caller's speech → first agent audio;
- barge-in (the caller talks over the answer): → `clear`, → last agent audio of the interrupted turn,
  and how much agent audio arrived after the `clear` before the caller finished (should be none);
- gaps: silences over 100 ms inside the agent's replies, where its playout buffer ran dry.

It dials as Twilio does: given the agent's voice webhook (http://…/twiml) it POSTs to it and streams to the TwiML's
<Stream> URL (or straight to a ws://…/ws URL). A full agent refuses the call with <Reject>, or closes the media stream
at its start with code 1013; the caller records which, and the time from dialing until it knew.

    python -m examples.pipecat_phone_agent.caller ws://127.0.0.1:8765/ws --calls 4 --out out/calls
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import statistics
import sys
import urllib.parse
import urllib.request
import uuid
import wave
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import numpy as np
import websockets

from . import mulaw
from .admission import BUSY_CLOSE_CODE

PACKET_S = mulaw.PACKET_BYTES / mulaw.RATE
GAP_S = 0.1  # a silence inside a reply longer than this is a gap in the agent's audio


class CallRefused(Exception):
    """The agent turned the call away: its TwiML answer was <Reject>, or it closed the media stream as busy."""

    def __init__(self, by: str, reason: str, at: float):
        super().__init__(f"refused at the {by}: {reason}")
        self.by = by  # "twiml" | "stream"
        self.reason = reason
        self.at = at  # when the caller knew (event loop time)


@dataclass(frozen=True)
class CallScript:
    """What the caller does: wait for the greeting, ask, barge in on the answer, hear the reply, hang up."""

    question: bytes  # 8 kHz μ-law
    barge_in: bytes
    barge_in_after_s: float = 1.0  # agent audio heard before the caller talks over it
    idle_s: float = 1.5  # agent silence that means it finished talking
    listen_s: float = 2.0  # how long to hear the last reply before hanging up
    timeout_s: float = 60.0  # longest wait for any agent reaction


@dataclass
class _Utterance:
    packets: deque[bytes]
    done: asyncio.Future[tuple[float, float]]
    voiced_s: float  # where the speech in it ends (the rest is the recording's trailing silence)
    start: float | None = None


@dataclass
class Line:
    """The caller's end of one media stream: a real-time microphone, a playout buffer, a log of events."""

    ws: Any
    stream_sid: str = field(default_factory=lambda: "MZ" + uuid.uuid4().hex)
    call_sid: str = field(default_factory=lambda: "CA" + uuid.uuid4().hex)
    t0: float = 0.0
    sent: bytearray = field(default_factory=bytearray)  # the caller's channel, one packet per 20 ms since t0
    media: list[tuple[float, bytes]] = field(default_factory=list)  # agent audio: (arrival time, μ-law)
    heard: list[list[Any]] = field(default_factory=list)  # playout: [start time, μ-law], cut by `clear`
    clears: list[float] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (time, what) of the caller's actions
    play_until: float = 0.0
    closed_at: float | None = None  # when the media stream closed (either side)
    _sequence: int = 0
    _queue: deque[_Utterance] = field(default_factory=deque)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------ protocol
    async def open(self) -> None:
        """Send Twilio's `connected` and `start` messages, then stream the microphone and listen."""
        start = {
            "streamSid": self.stream_sid,
            "accountSid": "AC" + "0" * 32,
            "callSid": self.call_sid,
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": mulaw.RATE, "channels": 1},
            "customParameters": {},
        }
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await self._send("start", start=start)
        self.t0 = self.play_until = self.now()
        self._tasks = [asyncio.create_task(self._microphone()), asyncio.create_task(self._listen())]

    async def hang_up(self) -> None:
        """Send `stop` and close, as Twilio does when the caller hangs up."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        stop = {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid}
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._send("stop", stop=stop)
        await self.ws.close()

    async def _send(self, event: str, **fields: Any) -> None:
        """One Media Streams message, numbered like Twilio's."""
        self._sequence += 1
        message = {"event": event, "sequenceNumber": str(self._sequence), **fields, "streamSid": self.stream_sid}
        await self.ws.send(json.dumps(message))

    async def _microphone(self) -> None:
        """One 20 ms media message per tick of a real-time clock: queued speech, else silence."""
        n = 0
        try:
            while True:
                await asyncio.sleep(max(0.0, self.t0 + n * PACKET_S - self.now()))
                packet = self._next_packet()
                media = {"track": "inbound", "chunk": str(n + 1), "timestamp": str(n * 20)}
                await self._send("media", media={**media, "payload": base64.b64encode(packet).decode()})
                self.sent += packet
                n += 1
                self._utterance_sent()
        except websockets.ConnectionClosed:
            for utterance in self._queue:
                utterance.done.set_exception(ConnectionError("the agent closed the media stream"))

    def _next_packet(self) -> bytes:
        if not self._queue:
            return mulaw.silence(PACKET_S)
        utterance = self._queue[0]
        if utterance.start is None:
            utterance.start = self.now()
        return utterance.packets.popleft()

    def _utterance_sent(self) -> None:
        if self._queue and not self._queue[0].packets:
            utterance = self._queue.popleft()
            utterance.done.set_result((utterance.start, utterance.start + utterance.voiced_s))

    async def _listen(self) -> None:
        try:
            async for raw in self.ws:
                message, now = json.loads(raw), self.now()
                if message.get("event") == "media":
                    self._play(now, base64.b64decode(message["media"]["payload"]))
                elif message.get("event") == "clear":
                    self._clear(now)
        finally:
            self.closed_at = self.now()

    # ------------------------------------------------------------ playout (Twilio's buffer)
    def _play(self, now: float, payload: bytes) -> None:
        self.media.append((now, payload))
        start = max(now, self.play_until)
        self.heard.append([start, payload])
        self.play_until = start + len(payload) / mulaw.RATE

    def _clear(self, now: float) -> None:
        """Drop the agent audio not yet played, as Twilio does on `clear`."""
        self.clears.append(now)
        self.heard = [seg for seg in self.heard if seg[0] < now]
        for seg in self.heard:
            seg[1] = seg[1][: max(0, round((now - seg[0]) * mulaw.RATE))]
        self.play_until = min(self.play_until, now)

    # ------------------------------------------------------------ caller actions
    async def say(self, ulaw: bytes) -> tuple[float, float]:
        """Speak in real time; returns when the last packet is sent, with the times speech started and ended."""
        packets = deque(ulaw[i : i + mulaw.PACKET_BYTES] for i in range(0, len(ulaw), mulaw.PACKET_BYTES))
        if len(packets[-1]) < mulaw.PACKET_BYTES:
            packets[-1] += mulaw.silence((mulaw.PACKET_BYTES - len(packets[-1])) / mulaw.RATE)
        if self._tasks[0].done():
            raise ConnectionError("the agent closed the media stream")
        utterance = _Utterance(packets, asyncio.get_running_loop().create_future(), mulaw.voiced_until(ulaw))
        self._queue.append(utterance)
        start, end = await utterance.done
        self.events += [(start, "caller speaks"), (end, "caller stops")]
        return start, end

    async def wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll `condition()` until it returns something truthy."""
        deadline = self.now() + timeout
        while not (result := condition()):
            if self.now() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f} s")
            await asyncio.sleep(0.005)
        return result

    async def greeting(self, timeout: float) -> float:
        """Arrival time of the agent's first audio; CallRefused if the agent closes the stream as busy before it."""
        await self.wait(lambda: self.media or self.closed_at is not None, timeout, "agent audio")
        if self.media:
            return self.media[0][0]
        if self.ws.close_code == BUSY_CLOSE_CODE:
            raise CallRefused("stream", self.ws.close_reason, self.closed_at)
        raise ConnectionError(f"the agent closed the media stream ({self.ws.close_code} {self.ws.close_reason!r})")

    def agent_hung_up(self) -> bool:
        """Whether the agent has closed the media stream (ended the call) since `open`."""
        return len(self._tasks) == 2 and self._tasks[1].done()

    async def first_audio_after(self, t: float, timeout: float) -> float:
        """Arrival time of the first agent audio after `t`."""
        return await self.wait(lambda: next((a for a, _ in self.media if a > t), None), timeout, "agent audio")

    async def agent_idle(self, idle_s: float, timeout: float) -> None:
        """Wait until the agent has been silent (nothing playing, nothing arriving) for `idle_s`."""
        await self.wait(lambda: self.now() - max(self.play_until, self.media[-1][0]) >= idle_s, timeout, "pause")

    # ------------------------------------------------------------ results
    def audio_seconds(self, start: float, end: float) -> float:
        """Seconds of agent audio that arrived in (start, end]."""
        return sum(len(p) for a, p in self.media if start < a <= end) / mulaw.RATE

    def gaps(self, start: float, end: float, over_s: float = GAP_S) -> list[float]:
        """Silences longer than `over_s` between pieces of agent audio heard in (start, end): buffer underruns."""
        pieces = sorted((s, s + len(p) / mulaw.RATE) for s, p in self.heard if start < s <= end and p)
        return [b[0] - a[1] for a, b in zip(pieces, pieces[1:]) if b[0] - a[1] > over_s]

    def timeline(self, gap_s: float = 0.2) -> list[list[Any]]:
        """[ms since open, what] for caller speech, `clear`s and agent audio bursts (arrivals < gap_s apart)."""
        items = [(t, what) for t, what in self.events] + [(t, "clear") for t in self.clears]
        burst_start = prev = None
        for arrival, _ in self.media:
            if prev is None or arrival - prev > gap_s:
                if burst_start is not None:
                    items.append((burst_start, f"agent audio until {_ms(prev - self.t0)}"))
                burst_start = arrival
            prev = arrival
        if burst_start is not None:
            items.append((burst_start, f"agent audio until {_ms(prev - self.t0)}"))
        return [[_ms(t - self.t0), what] for t, what in sorted(items)]

    def write_wav(self, path: Path) -> None:
        """Stereo 8 kHz: left what the caller said, right the agent as the caller heard it."""
        caller = mulaw.decode(bytes(self.sent))
        agent = np.zeros(max(caller.size, round((self.play_until - self.t0) * mulaw.RATE) + 1), dtype=np.int16)
        for start, payload in self.heard:
            pcm = mulaw.decode(payload)
            at = round((start - self.t0) * mulaw.RATE)
            agent[at : at + pcm.size] = pcm[: agent.size - at]
        stereo = np.zeros((agent.size, 2), dtype=np.int16)
        stereo[: caller.size, 0] = caller
        stereo[:, 1] = agent
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as w:
            w.setnchannels(2)
            w.setsampwidth(2)
            w.setframerate(mulaw.RATE)
            w.writeframes(stereo.tobytes())


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _post(url: str, form: dict[str, str]) -> bytes:
    """POST `form` to `url`, as Twilio calls a voice webhook; the answer's body."""
    request = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


async def dial(url: str, call_sid: str) -> str:
    """The call's media stream URL: `url` itself if it is one (ws://), else the <Stream> of the TwiML that the voice
    webhook at `url` (http://) answers; CallRefused if it answers <Reject>."""
    if not url.startswith(("http://", "https://")):
        return url
    answer = ElementTree.fromstring(await asyncio.to_thread(_post, url, {"CallSid": call_sid}))
    if (reject := answer.find("Reject")) is not None:
        raise CallRefused("twiml", reject.get("reason", "rejected"), asyncio.get_running_loop().time())
    return answer.find("Connect/Stream").get("url")


async def place_call(url: str, script: CallScript, wav_path: Path) -> dict[str, Any]:
    """One scripted call, dialed at `url` (the TwiML webhook or the media stream: `dial`); returns its report, with
    `refused` (by what, why, ms from dialing) if the agent turned it away, `error` if it failed to react in time."""
    report: dict[str, Any] = {"wav": None, "turns": [], "barge_in": None, "error": None, "refused": None}
    dialed, call_sid = asyncio.get_running_loop().time(), "CA" + uuid.uuid4().hex
    try:
        line = await _talk(await dial(url, call_sid), call_sid, script, report)
    except CallRefused as refusal:
        report["refused"] = {"by": refusal.by, "reason": refusal.reason, "ms": _ms(refusal.at - dialed)}
        return report
    line.write_wav(wav_path)
    report["wav"] = str(wav_path)
    report["agent_audio_received_s"] = round(line.audio_seconds(line.t0, float("inf")), 3)
    report["timeline_ms"] = line.timeline()
    return report


async def _talk(stream_url: str, call_sid: str, script: CallScript, report: dict[str, Any]) -> Line:
    """The script on the call's media stream, hung up at its end or at a failure (noted in `report`)."""
    async with websockets.connect(stream_url, max_size=None) as ws:
        line = Line(ws, call_sid=call_sid)
        report["stream_sid"] = line.stream_sid
        try:
            await _converse(line, script, report)
        except (TimeoutError, ConnectionError) as exc:
            report["error"] = str(exc)
        finally:
            await line.hang_up()
    return line


async def _converse(line: Line, script: CallScript, report: dict[str, Any]) -> None:
    await line.open()
    greeting = await line.greeting(script.timeout_s)
    report["greeting_ms"] = _ms(greeting - line.t0)
    await line.agent_idle(script.idle_s, script.timeout_s)

    question, asked = await line.say(script.question)
    answer = await line.first_audio_after(asked, script.timeout_s)
    report["turns"].append(_turn("question", asked, answer))

    await asyncio.sleep(max(0.0, answer + script.barge_in_after_s - line.now()))
    barge, barge_end = await line.say(script.barge_in)
    clear = next((c for c in line.clears if c > barge), None)
    last = max((a for a, _ in line.media if barge < a <= barge_end), default=None)
    report["barge_in"] = {
        "agent_audio_heard_before_ms": _ms(barge - answer),
        "to_clear_ms": _ms(clear - barge) if clear else None,
        "to_last_agent_audio_ms": _ms(last - barge) if last else None,
        "agent_audio_after_clear_ms": _ms(line.audio_seconds(clear, barge_end)) if clear else None,
    }

    reply = await line.first_audio_after(barge_end, script.timeout_s)
    report["turns"].append(_turn("barge_in", barge_end, reply))
    await asyncio.sleep(script.listen_s)
    # The agent's replies: the greeting until the question, the answer until the barge-in, the last reply.
    replies = [(line.t0, question), (asked, barge), (barge_end, line.now())]
    report["agent_audio_gaps_ms"] = [_ms(g) for start, end in replies for g in line.gaps(start, end)]


def _turn(said: str, speech_end: float, first_audio: float) -> dict[str, Any]:
    """One caller turn: its latency, and both ends on the machine's monotonic clock (the server's moments too)."""
    return {
        "said": said,
        "speech_end_to_agent_audio_ms": _ms(first_audio - speech_end),
        "speech_end_monotonic": speech_end,
        "first_audio_monotonic": first_audio,
    }


async def run_calls(url: str, script: CallScript, out_dir: Path, calls: int = 4, stagger_s: float = 0.25) -> dict:
    """`calls` concurrent scripted calls (started `stagger_s` apart); the report of all of them."""

    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(i * stagger_s)
        return {"call": i, **await place_call(url, script, out_dir / f"call-{i}.wav")}

    results = await asyncio.gather(*(one(i) for i in range(calls)))
    gaps = sum(len(c.get("agent_audio_gaps_ms", [])) for c in results)
    refused = [c["refused"]["by"] for c in results if c["refused"]]
    return {
        "calls": results,
        "summary": summarize(results),
        "agent_audio_gaps_over_100ms": gaps,
        "admitted": len(results) - len(refused),
        "refused": {"twiml": refused.count("twiml"), "stream": refused.count("stream")},
    }


def summarize(calls: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / p95 / max of every latency across calls, and of the refused calls' time to refusal."""
    series: dict[str, list[float]] = {
        "greeting_ms": [c.get("greeting_ms") for c in calls],
        "speech_end_to_agent_audio_ms": [t["speech_end_to_agent_audio_ms"] for c in calls for t in c["turns"]],
    }
    for key in ("to_clear_ms", "to_last_agent_audio_ms", "agent_audio_after_clear_ms"):
        series[f"barge_in_{key}"] = [(c["barge_in"] or {}).get(key) for c in calls]
    series["dial_to_refusal_ms"] = [c["refused"]["ms"] for c in calls if c.get("refused")]
    return {key: _spread(values) for key, values in series.items() if any(v is not None for v in values)}


def _spread(values: list[float | None]) -> dict[str, float]:
    """n, min, median, p95 (nearest rank) and max of the values that are not None."""
    ordered = sorted(v for v in values if v is not None)
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]
    return {"n": len(ordered), "min": ordered[0], "median": statistics.median(ordered), "p95": p95, "max": ordered[-1]}


def print_summary(report: dict[str, Any]) -> None:
    print(f"{'latency (ms)':<40}{'n':>4}{'min':>9}{'median':>9}{'p95':>9}{'max':>9}")
    for key, s in report["summary"].items():
        print(f"{key:<40}{s['n']:>4}{s['min']:>9.0f}{s['median']:>9.0f}{s['p95']:>9.0f}{s['max']:>9.0f}")
    refused = report["refused"]
    print(
        f"calls: {report['admitted']} admitted, {sum(refused.values())} refused as busy ({refused['twiml']} by the "
        f"TwiML answer, {refused['stream']} at the media stream's start)"
    )
    print(f"agent audio gaps over {GAP_S * 1000:.0f} ms (admitted calls): {report['agent_audio_gaps_over_100ms']}")
    for call in report["calls"]:
        if call["error"]:
            print(f"call {call['call']}: {call['error']}")


def main(argv: list[str] | None = None) -> int:
    from .make_fixtures import load_fixtures

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "url", help="the agent's TwiML webhook (http://127.0.0.1:8765/twiml) or media stream (ws://127.0.0.1:8765/ws)"
    )
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--fixtures", default="out/phone-agent/fixtures", help="made by make_fixtures if missing")
    parser.add_argument("--out", default="out/phone-agent/calls")
    args = parser.parse_args(argv)
    lines = load_fixtures(args.fixtures)
    script = CallScript(question=lines["question"], barge_in=lines["barge_in"])
    out = Path(args.out)
    report = asyncio.run(run_calls(args.url, script, out, calls=args.calls))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"report: {out / 'report.json'}; recordings: {out}/call-*.wav")
    return 0 if all(c["error"] is None for c in report["calls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
