"""`orpheus-tts serve` on Ray Serve: one engine per replica (a GPU each, or CPUs), the same app, routed per stream.

    serve run orpheus_tts_plugin.server.ray:app model=DIR snac=DIR backend=hf device=cpu min_replicas=1 max_replicas=4

`app` takes the `serve` flags as key=value (dashes or underscores), plus:
  min_replicas, max_replicas (default 1, 1); target_streams (open streams a replica should carry before another
  starts; default 3/4 of max_streams); drain_timeout (seconds a stopping replica lets its open streams finish,
  Ray's graceful_shutdown_timeout_s; default DRAIN_S); upscale_delay, downscale_delay, scale_window (the seconds
  of open streams averaged for each decision, Ray's look_back_period_s), health_period (seconds);
  cpus (per replica on CPU, default 1); gpus (per replica; default 1 unless device=cpu).

Ray's proxy routes each request, and a WebSocket once, for its life. So each replica's hello names `streams_path`,
and RemoteEngine posts every stream as an HTTP request of its own and holds no socket once it has the hello: streams
spread one by one (`ray_router`: to the replica with the fewest, a burst too), and a replica's open requests are its
open streams, what autoscaling counts and what a stopping replica drains. Cloned voices live in the application's
registry actor (`ray_voices`; or in `voices_dir`, a folder every node mounts), so every replica speaks them, one
started later too. Ray is an optional extra
(`pip install orpheus-tts-plugin[ray]`); nothing else imports this module.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..errors import missing_extra

try:
    from ray import serve
    from ray.serve import Application, Deployment
    from ray.serve.config import RequestRouterConfig
except ImportError as exc:
    raise missing_extra("ray", "orpheus-tts on Ray Serve", exc) from None

from ..engine.core import OrpheusEngine
from . import serve as serve_cli
from .app import create_app
from .ray_router import IMPORT_PATH as ROUTER
from .ray_voices import RayVoiceStore

DRAIN_S = 300.0  # the longest utterance a default engine speaks (its token budget) fits well within this
TARGET_SHARE = 0.75  # a replica at this share of max_streams asks for another
SERVE_ONLY = ("host", "port", "uds", "ssl_certfile", "ssl_keyfile", "cpus", "log_level")  # uvicorn's, not Ray's


class OrpheusReplica:
    """One replica: an engine and `create_app`'s app around it, named for Ray Serve's replica id; its cloned voices
    those of the application's registry (or of `voices_dir`)."""

    def __init__(self, args: argparse.Namespace):
        self.engine = OrpheusEngine(serve_cli.engine_config(args))
        self.policy = serve_cli.policy(args)
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.voice_store = serve_cli.voice_store(args) or RayVoiceStore(context.app_name)

    async def __serve_build_asgi_app__(self) -> Any:
        """The app, once the engine has loaded: Ray routes nothing to a replica before this returns."""
        await self.engine.start()
        return create_app(self.engine, policy=self.policy, replica=self.name, voice_store=self.voice_store)

    def check_health(self) -> None:
        """Ray's health check: an engine that failed or closed makes the replica unhealthy, and Ray replaces it."""
        health = self.engine.health()
        if health["status"] in ("failed", "closed"):
            raise RuntimeError(f"engine {health['status']}: {health['reason']}")


def parse(args: dict[str, Any]) -> tuple[argparse.Namespace, dict[str, float]]:
    """(the `serve` flags, the Ray options) of `app`'s key=value arguments; ValueError naming an unknown key."""
    parser = argparse.ArgumentParser(prog="orpheus_tts_plugin.server.ray:app", add_help=False, exit_on_error=False)
    serve_cli.add_arguments(parser)
    ray_keys = {
        "min_replicas": 1,
        "max_replicas": 1,
        "target_streams": None,
        "drain_timeout": DRAIN_S,
        "upscale_delay": 30.0,
        "downscale_delay": 600.0,
        "scale_window": 30.0,
        "health_period": 10.0,
        "gpus": None,
        "cpus": None,
    }
    ray_options: dict[str, Any] = dict(ray_keys)
    known = set(vars(parser.parse_args([]))) - set(SERVE_ONLY)  # every flag's name (none is required)
    argv: list[str] = []
    for key, value in args.items():
        name = key.replace("-", "_")
        if name not in known and name not in ray_keys:
            options = ", ".join(ray_keys)
            raise ValueError(f"orpheus_tts_plugin.server.ray:app: unknown argument {key!r} (serve's flags, {options})")
        if name in ray_keys and name != "drain_timeout":
            ray_options[name] = None if value is None else float(value)
            continue
        if name == "drain_timeout":
            ray_options[name] = float(value)
        if name in ("compile",):
            if str(value).lower() in ("1", "true", "yes"):
                argv.append("--compile")
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            argv += [f"--{name.replace('_', '-')}", str(item)]
    try:
        parsed = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"orpheus_tts_plugin.server.ray:app: {exc}") from None
    return parsed, ray_options


def report_interval(window_s: float) -> dict[str, float]:
    """How often a replica reports its open requests: Ray's default (10 s, its `metrics_interval_s`, deprecated
    but still read) unless the window is shorter; then twice a window, which the window needs to see anything."""
    return {} if window_s > 10.0 else {"metrics_interval_s": window_s / 2}


def app(args: dict[str, Any]) -> Application:
    """The application builder (`serve run orpheus_tts_plugin.server.ray:app KEY=VALUE ...`, or a Serve config's
    `import_path` and `args`)."""
    built, parsed = deployment(args)
    return built.bind(parsed)


def deployment(args: dict[str, Any]) -> tuple[Deployment, argparse.Namespace]:
    """(the replicas' deployment, the `serve` flags it is bound to) of `app`'s arguments: a test binds a replica
    class of its own to the same options (`Deployment.options(func_or_class=...)`)."""
    parsed, o = parse(args)
    config = serve_cli.engine_config(parsed)
    target = o["target_streams"] or max(1, math.ceil(TARGET_SHARE * config.max_streams))
    gpus = o["gpus"] if o["gpus"] is not None else (0.0 if config.device == "cpu" else 1.0)
    actor = {"num_gpus": gpus} if gpus else {"num_cpus": o["cpus"] or 1.0}
    built = serve.deployment(
        serve.ingress(None)(OrpheusReplica),
        name="orpheus",
        ray_actor_options=actor,
        # Ray's cap on a replica's open requests: the engine admits and refuses (max_streams) itself; the cap only
        # leaves room for health checks and hellos, which Ray counts too.
        max_ongoing_requests=2 * config.max_streams + 16,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),
        autoscaling_config={
            "min_replicas": int(o["min_replicas"]),
            "max_replicas": int(o["max_replicas"]),
            "initial_replicas": int(o["min_replicas"]),
            "target_ongoing_requests": float(target),
            "upscale_delay_s": o["upscale_delay"],
            "downscale_delay_s": o["downscale_delay"],
            "look_back_period_s": o["scale_window"],
            **report_interval(o["scale_window"]),
        },
        graceful_shutdown_timeout_s=o["drain_timeout"],
        health_check_period_s=o["health_period"],
    )
    return built, parsed
