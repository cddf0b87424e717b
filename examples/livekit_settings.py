"""The LiveKit example's settings: read from ORPHEUS_* environment variables and checked before anything loads.

The environment is the one place they live: the example's flags are written into it, and LiveKit's job
processes (and its CLI, which imports the agent file itself) inherit it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from orpheus_tts_plugin import EngineConfig
from orpheus_tts_plugin.client.upstream import server_urls
from orpheus_tts_plugin.errors import EngineError
from orpheus_tts_plugin.preflight import check_before_load
from orpheus_tts_plugin.spec import spec_for

# Setting → its environment variable (the flag of the same name, `--snac`, `--server-url`, ..., overrides it).
ENV = {
    "model": "ORPHEUS_MODEL",
    "snac": "ORPHEUS_SNAC",
    "backend": "ORPHEUS_BACKEND",
    "device": "ORPHEUS_DEVICE",
    "server_url": "ORPHEUS_SERVER_URL",
    "voice": "ORPHEUS_VOICE",
    "max_calls": "ORPHEUS_MAX_CALLS",
    "load_threshold": "ORPHEUS_LOAD_THRESHOLD",
    "fallback_tts": "ORPHEUS_FALLBACK_TTS",
}
# The errors a setting can be wrong with; each is one line naming the fix (preflight's and weights' messages).
SETTING_ERRORS = (EngineError, ImportError, ValueError, TypeError)


@dataclass(frozen=True)
class Settings:
    """What the example's worker runs: its engine (in process, or `orpheus-tts serve` URLs), voice and limits."""

    model: str | None = EngineConfig.model
    snac: str = EngineConfig.snac
    backend: str = EngineConfig.backend
    device: str = EngineConfig.device
    server_url: str | None = None  # one or more `orpheus-tts serve` URLs, comma-separated: then no model loads here
    voice: str = "tara"
    max_calls: int = 64
    load_threshold: float = 0.8
    fallback_tts: str | None = None  # a LiveKit Inference TTS, e.g. cartesia/sonic-3

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """The settings the environment gives, defaults for the rest; ValueError naming a variable that is no number."""
        given = {name: env[var] for name, var in ENV.items() if env.get(var)}
        for name, kind in (("max_calls", int), ("load_threshold", float)):
            if name in given:
                try:
                    given[name] = kind(given[name])
                except ValueError:
                    raise ValueError(f"{ENV[name]}={given[name]!r} is not a number") from None
        return cls(**given)

    @property
    def engine(self) -> EngineConfig:
        """The in-process engine's config (unused with `server_url`)."""
        return EngineConfig(model=self.model, snac=self.snac, backend=self.backend, device=self.device)

    def check(self) -> Settings:
        """Raise, in one line, what the worker would fail on (voice, backend, weights, device, URLs); load nothing."""
        if not 1 <= self.max_calls:
            raise ValueError(f"{ENV['max_calls']} must be >= 1, got {self.max_calls}")
        if not 0.0 < self.load_threshold <= 1.0:
            raise ValueError(f"{ENV['load_threshold']} must be in (0, 1], got {self.load_threshold}")
        if self.server_url:
            server_urls(self.server_url)
            spec_for(EngineConfig.model_family).check_voice(self.voice)
        else:
            check_before_load(self.engine, self.voice)
        return self


def settings_or_exit(program: str) -> Settings:
    """The environment's settings, checked; a wrong one ends the process with one line and status 2."""
    try:
        return Settings.from_env().check()
    except SETTING_ERRORS as exc:
        print(f"{program}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
