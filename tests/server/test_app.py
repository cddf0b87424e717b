"""The app's health, readiness and metrics: what they say of a serving engine and of one still loading."""

from __future__ import annotations

import threading

from orpheus_tts_plugin import (
    EngineConfig,
    OrpheusEngine,
    RemoteEngine,
    SyntheticConfig,
)
from orpheus_tts_plugin.backends.synthetic import SyntheticBackend
from orpheus_tts_plugin.server.serve import ServerThread, serving_in_thread
from tests.served import (
    engine_of,
    http,
    metric,
    pcm_of,
    until,
)


class HeldLoad(SyntheticBackend):
    """Synthetic tokens whose model load waits for `release`."""

    def __init__(self, config: SyntheticConfig):
        super().__init__(config)
        self.release = threading.Event()

    def _load(self) -> None:
        self.release.wait(60)


async def test_health_ready_and_metrics_describe_the_server(served: ServerThread, remote: RemoteEngine) -> None:
    await pcm_of(remote)
    assert http(served, "/health") == (200, b'{"status":"ok","reason":null,"draining":false}')
    assert http(served, "/ready")[0] == 200
    _, text = http(served, "/metrics")
    for name in (
        "orpheus_active_streams",
        "orpheus_streams_admitted_total",
        "orpheus_streams_rejected_total",
        "orpheus_ttfb_seconds_bucket",
        "orpheus_tokens_total",
        "orpheus_decoder_ticks_total",
        "orpheus_stream_errors_total",
        "orpheus_ws_connections",
    ):
        assert name.encode() in text, name
    assert metric(served, "orpheus_tokens_total") == engine_of(served).stats()["tokens"]
    assert metric(served, 'orpheus_ttfb_seconds_count{transport="ws"}') >= 1
    assert remote.ready and remote.health() == {"status": "ok", "reason": None}
    await until(lambda: remote.load < 1.0)  # status is pushed on change: an earlier test may have left it at 1.0
    assert remote.load >= 0.0


async def test_not_ready_while_the_engine_loads(synthetic_config: EngineConfig) -> None:
    backend = HeldLoad(synthetic_config.synthetic)
    engine = OrpheusEngine(synthetic_config, backend=backend)
    with serving_in_thread(engine) as srv:
        await until(lambda: engine.health()["status"] == "starting")
        assert http(srv, "/health")[0] == 200
        status, body = http(srv, "/ready")
        assert status == 503 and b"starting" in body
        remote = RemoteEngine(srv.url)
        await remote.start()  # connected: the server answers while it loads
        assert remote.health()["status"] == "starting" and not remote.ready
        backend.release.set()
        await until(lambda: http(srv, "/ready")[0] == 200)
        await until(lambda: remote.ready)
        assert (await pcm_of(remote)).size > 0
        await remote.aclose()
