"""What both transports share: the engine, admission while draining, readiness, per-request metrics, the drain."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from ..engine.core import OrpheusEngine
from ..errors import EngineError, EngineOverloadedError
from ..spec import SAMPLE_RATE
from ..speculation import Speculation
from ..types import AudioChunk, Usage
from ..wire import protocol
from .metrics import Metrics
from .policy import LimitError, Policy, StreamLimitError
from .shared_voices import SharedVoices
from .voice_store import VoiceStore

log = logging.getLogger(__name__)


class Subscriber(Protocol):
    """A WebSocket connection as the service sees it: it takes status messages and can say when it has sent all."""

    def on_status(self, message: dict[str, Any]) -> None: ...

    async def flushed(self) -> None: ...


class Service:
    """One engine behind the server; every method runs on the server's (uvicorn's) event loop."""

    def __init__(
        self,
        engine: OrpheusEngine,
        policy: Policy | None = None,
        replica: str | None = None,
        voice_store: VoiceStore | None = None,
    ):
        """`replica`: this server's name among replicas behind a balancing proxy (Ray Serve), else None;
        `voice_store`: where the deployment's cloned voices live (default: this server's memory)."""
        self.engine = engine
        self.policy = policy or Policy()
        self.replica = replica
        self.voices = SharedVoices(engine, voice_store)
        self.draining = False  # server loop only: set once by drain(), never cleared
        self.subscribers: set[Subscriber] = set()  # server loop only: the open WebSocket connections
        self.key_streams: collections.Counter[str] = collections.Counter()  # server loop only: open streams by key
        self.metrics = Metrics(self.stats)

    # ---------------------------------------------------------------- what the server says about itself
    def hello(self) -> protocol.Hello:
        cfg, spec = self.engine.config, self.engine.spec
        return protocol.Hello(
            model=cfg.model,
            model_family=cfg.model_family,
            voices=spec.voices,
            default_voice=spec.default_voice,
            sampling=cfg.sampling,
            max_streams=cfg.max_streams,
            sample_rate=SAMPLE_RATE,
            sentence_max_chars=cfg.sentence_max_chars,
            max_chars=self.policy.max_chars,
            adapters=cfg.adapter_names,
            replica=self.replica,
            speculation=True,
            # Behind a proxy that routes a WebSocket once, its clients POST each stream: balanced one by one.
            streams_path=protocol.STREAMS_PATH if self.replica is not None else None,
        )

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): not while the engine loads or has failed, while draining, or at capacity."""
        health = self.engine.health()
        if health["status"] != "ok":
            return False, f"engine {health['status']}: {health['reason']}"
        if self.draining:
            return False, "draining"
        if self.engine.load >= 1.0:
            return False, f"at capacity ({self.engine.config.max_streams} streams)"
        return True, "ok"

    def status(self) -> dict[str, Any]:
        """The `status` message: readiness, load, engine health, the voices (cloned ones come and go)."""
        ready, reason = self.readiness()
        health = self.engine.health()
        return {
            "type": "status",
            "ready": ready,
            "reason": reason,
            "draining": self.draining,
            "load": round(self.engine.load, 4),
            "status": health["status"],
            "voices": list(self.engine.spec.voices),
        }

    def stats(self) -> dict[str, Any]:
        """The engine's stats plus load, readiness, voices and this process's CPU time (what load tests add up); a
        client that posts its streams (behind a proxy) polls it for the load and the voices."""
        ready, _ = self.readiness()
        return {
            **self.engine.stats(),
            "load": self.engine.load,
            "ready": ready,
            "draining": self.draining,
            "voices": list(self.engine.spec.voices),
            "process_cpu_s": time.process_time(),
        }

    def publish(self) -> None:
        """Send the current status to every subscriber (each WebSocket connection)."""
        message = self.status()
        for subscriber in list(self.subscribers):
            subscriber.on_status(message)

    async def publish_changes(self, interval_s: float) -> None:
        """Publish the status whenever it changed, checking every `interval_s` (runs for the server's life)."""
        last: dict[str, Any] | None = None
        while True:
            current = self.status()
            if current != last:
                self.publish()
                last = current
            await asyncio.sleep(interval_s)

    # ---------------------------------------------------------------- speaking
    async def speak(
        self,
        request: protocol.Start,
        transport: str,
        received: float,
        key: str | None = None,
        hold: Callable[[Speculation], None] | None = None,
        *,
        usage: Usage | None = None,
    ) -> AsyncGenerator[AudioChunk, None]:
        """The engine's chunks for `request`, counted; `received` is when the request arrived (perf_counter),
        `key` the API key it came with (its streams are counted against `Policy.streams_per_key`). A speculative
        request is spoken as one only where its client can confirm it (`hold` given): `hold` then takes its
        speculation, to settle when the client says (its stream ending early still discards it). `usage`: what the
        engine counts the stream's tokens into (`Speech.usage`)."""
        m = self.metrics
        m.requests.labels(transport).inc()
        held = False
        try:
            if self.draining:
                raise EngineOverloadedError("server is draining: retry on another replica")
            if key is not None:
                limit = self.policy.key_streams(self.engine.config.max_streams)
                if self.key_streams[key] >= limit:
                    raise StreamLimitError(
                        f"this API key has {limit} streams open, its limit on this server (serve --streams-per-key)"
                    )
                self.key_streams[key] += 1
                held = True
            await self.voices.knows(request.voice)  # one added on another server since the last sync
            chunks = self.engine.synthesize(
                request.text,
                voice=request.voice,
                sampling=request.sampling,
                adapter=request.adapter,
                speed=request.speed,
                speculative=request.speculative and hold is not None,
                usage=usage,
            )
            if chunks.speculative:
                hold(chunks.take_speculation())
            first = True
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if first:
                        m.ttfb.labels(transport).observe(time.perf_counter() - received)
                        first = False
                    yield chunk
        except EngineOverloadedError:
            m.rejected.labels(transport).inc()
            raise
        except (EngineError, ValueError, TypeError) as exc:
            m.errors.labels(transport, protocol.error_name(exc)).inc()
            raise
        finally:
            if held:
                self.key_streams[key] -= 1
                if not self.key_streams[key]:
                    del self.key_streams[key]

    def refused(self, exc: BaseException, transport: str) -> None:
        """Count a request refused before it reached `speak` (malformed, over a limit)."""
        self.metrics.requests.labels(transport).inc()
        if isinstance(exc, EngineOverloadedError):
            self.metrics.rejected.labels(transport).inc()
            return
        self.metrics.errors.labels(transport, protocol.error_name(exc)).inc()
        if isinstance(exc, LimitError):
            self.metrics.over_limit.labels(transport).inc()

    # ---------------------------------------------------------------- shutdown
    async def drain(self, timeout_s: float, poll_s: float = 0.02) -> bool:
        """Stop admitting, let open streams finish until `timeout_s`, then end the rest; True if none was cut."""
        self.draining = True
        self.publish()
        deadline = time.monotonic() + timeout_s
        while self.engine.stats()["active_streams"] and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        left = self.engine.stats()["active_streams"]
        if left:
            log.warning("drain deadline (%g s) passed with %d streams open: ending them", timeout_s, left)
            await self.engine.aclose()  # each open stream ends with an error its client receives
            await asyncio.sleep(0.05)  # let the stream tasks queue those errors
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(s.flushed() for s in self.subscribers)), 1.0)
        return left == 0
