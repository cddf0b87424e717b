"""The voice store of an application on Ray Serve: one registry actor per application, which every replica syncs with.

The registry is a named, detached actor (Ray's public actor API; no shared folder is needed across nodes): it
outlives a replica, a rollout and `serve.delete` (after which kill it with
`ray.kill(ray.get_actor(registry_name(APP), namespace=NAMESPACE))`). Ray restarts it if its node is lost; it then
comes back empty under a new epoch, and each replica puts back the voices it holds (`shared_voices`), as they do for
one killed while they run. It holds each voice's PCM (30 s at most: 1.44 MB).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from ..errors import missing_extra
from .voice_store import StoredVoice, VoiceStoreError, taken

try:
    import ray
    from ray.exceptions import RayError
except ImportError as exc:
    raise missing_extra("ray", "orpheus-tts on Ray Serve", exc) from None

NAMESPACE = "orpheus-tts"


def registry_name(app_name: str) -> str:
    """The registry actor's name for a Serve application."""
    return f"voices-{app_name}"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class VoiceRegistry:
    """An application's cloned voices by name (Ray runs one method at a time: no lock)."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex  # a new one after a restart: the replicas then put their voices back
        self.voices: dict[str, tuple[str, bytes, str]] = {}  # (transcript, pcm, tag) by name

    def listing(self) -> tuple[str, dict[str, str]]:
        return self.epoch, {name: tag for name, (_, _, tag) in self.voices.items()}

    def get(self, name: str) -> tuple[str, bytes] | None:
        found = self.voices.get(name)
        return None if found is None else found[:2]

    def put(self, name: str, transcript: str, pcm: bytes) -> str | None:
        """Keep the voice unless the name is taken: its tag, or None."""
        if name in self.voices:
            return None
        tag = uuid.uuid4().hex
        self.voices[name] = (transcript, pcm, tag)
        return tag

    def remove(self, name: str) -> bool:
        return self.voices.pop(name, None) is not None


class RayVoiceStore:
    """`VoiceStore` over an application's `VoiceRegistry` (found, or started, at the first call)."""

    def __init__(self, app_name: str):
        self.name = registry_name(app_name)
        self._registry: Any = None  # its handle, once found or started

    async def listing(self) -> tuple[str, dict[str, str]]:
        epoch, tags = await self._call("listing")
        return epoch, tags

    async def get(self, name: str) -> StoredVoice | None:
        found = await self._call("get", name)
        return None if found is None else StoredVoice(name, *found)

    async def put(self, voice: StoredVoice) -> str:
        tag = await self._call("put", voice.name, voice.transcript, voice.pcm)
        if tag is None:
            raise taken(voice.name)
        return tag

    async def remove(self, name: str) -> bool:
        return await self._call("remove", name)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            if self._registry is None:  # a lookup in Ray's control store: not on the event loop
                self._registry = await asyncio.to_thread(self._find_or_start)
            return await getattr(self._registry, method).remote(*args)
        except RayError as exc:
            self._registry = None  # killed for good, perhaps: the next call finds or starts one again
            first = (str(exc).strip().splitlines() or [""])[0]  # Ray's messages carry tracebacks
            raise VoiceStoreError(f"voice registry {self.name!r}: {type(exc).__name__}: {first}") from None

    def _find_or_start(self) -> Any:
        options = {"name": self.name, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True}
        return VoiceRegistry.options(**options).remote()
