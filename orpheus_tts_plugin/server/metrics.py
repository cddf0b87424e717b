"""`/metrics`: the server's Prometheus figures, one registry per app (so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import missing_extra
from ..speculation import CONFIRMED, DISCARDED

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:
    raise missing_extra("server", "orpheus-tts serve's /metrics", exc) from None

TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

# engine stats() counter → (metric name without _total, help)
ENGINE_COUNTERS = {
    "streams_started": ("orpheus_streams_admitted", "Streams the engine admitted"),
    "streams_rejected": ("orpheus_engine_streams_rejected", "Streams the engine refused at max_streams"),
    "queue_timeouts": ("orpheus_queue_timeouts", "Streams whose first token did not come within queue_timeout_s"),
    "streams_completed": ("orpheus_streams_completed", "Streams that delivered their final chunk"),
    "streams_cancelled": ("orpheus_streams_cancelled", "Streams their caller left before the end"),
    "tokens": ("orpheus_tokens", "Tokens generated"),
    "frames": ("orpheus_frames", "SNAC frames parsed from the generated tokens"),
    "decoder_ticks": ("orpheus_decoder_ticks", "Decoder thread ticks (batched decode rounds)"),
}


class _EngineCollector(Collector):
    """Reads the engine's own counters at scrape time, so that nothing is counted twice or per chunk."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("orpheus_active_streams", "Streams open in the engine", value=stats["active_streams"])
        yield GaugeMetricFamily("orpheus_load", "Fraction of max_streams in use", value=stats["load"])
        yield GaugeMetricFamily("orpheus_ready", "1 if /ready would answer 200", value=float(stats["ready"]))
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        yield from _speculation_metrics(stats)


def _speculation_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Speculative streams (a reply spoken before the caller's turn is confirmed): started, settled by outcome, and
    what the discarded ones cost the engine."""
    yield CounterMetricFamily(
        "orpheus_speculative_streams_started", "Speculative streams admitted", value=stats.get("speculative_started", 0)
    )
    settled = CounterMetricFamily(
        "orpheus_speculative_streams_settled",
        "Speculative streams by outcome (confirmed, discarded)",
        labels=["outcome"],
    )
    for outcome in (CONFIRMED, DISCARDED):
        settled.add_metric([outcome], stats.get(f"speculative_{outcome}", 0))
    yield settled
    yield CounterMetricFamily(
        "orpheus_speculative_discarded_audio_seconds",
        "Audio seconds the engine generated for discarded speculative streams (the work thrown away)",
        value=stats.get("speculative_discarded_audio_s", 0),
    )
    yield CounterMetricFamily(
        "orpheus_speculative_discarded_open_seconds",
        "Stream-seconds discarded speculative streams held an engine slot",
        value=stats.get("speculative_discarded_open_s", 0),
    )


class Metrics:
    """The per-request figures both transports record (labelled `transport`: ws | http) and the engine's counters."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        """`stats()`: the engine's stats() plus `load` and `ready`, read at each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("orpheus_requests", "Speech requests received", ["transport"], registry=reg)
        self.rejected = Counter(
            "orpheus_streams_rejected", "Requests refused as overloaded or draining", ["transport"], registry=reg
        )
        self.errors = Counter("orpheus_stream_errors", "Streams ended by an error", ["transport", "type"], registry=reg)
        self.ttfb = Histogram(
            "orpheus_ttfb_seconds",
            "Request received → first audio sent",
            ["transport"],
            buckets=TTFB_BUCKETS,
            registry=reg,
        )
        self.connections = Gauge("orpheus_ws_connections", "Open WebSocket connections", registry=reg)
        self.auth_failures = Counter(
            "orpheus_auth_failures", "Requests and connections refused for a missing or wrong API key", ["transport"],
            registry=reg,
        )  # fmt: skip
        self.slow_consumers = Counter(
            "orpheus_slow_consumers", "Streams ended because their client left its audio unread (WebSocket or HTTP)",
            registry=reg,
        )  # fmt: skip
        self.over_limit = Counter(
            "orpheus_requests_over_limit", "Requests refused as over a size, length or nesting limit", ["transport"],
            registry=reg,
        )  # fmt: skip
        reg.register(_EngineCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
