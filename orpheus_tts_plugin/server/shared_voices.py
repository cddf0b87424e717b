"""A server's cloned voices, kept equal to its deployment's voice store: added or removed on any server, spoken or
refused by all.

`/v1/voices` adds to the engine (checked, encoded) and then to the store, and removes from both. Every server reads
the store's names (and each voice's tag) every SYNC_S and at once when a stream names a voice it does not know: it
fetches and encodes each new voice, drops each one the store no longer holds, and does both for one replaced under
its name. So a server that starts later (a new replica)
speaks every voice from its first request, and a voice added elsewhere is spoken even before the next sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

import numpy as np

from ..engine.core import OrpheusEngine
from .voice_store import MemoryVoiceStore, StoredVoice, VoiceStore, VoiceStoreError

log = logging.getLogger(__name__)

SYNC_S = 0.5  # how often a server reads the store's names (a voice removed elsewhere is gone within this)
STORE_TIMEOUT_S = 10.0  # the longest a store may take to answer one call
T = TypeVar("T")


def pcm16(audio: np.ndarray) -> bytes:
    """int16 little-endian bytes of a reference given as int16 or as float in [-1, 1] (what `read_wav` gives)."""
    if audio.dtype != np.int16:
        audio = np.clip(np.round(audio.astype(np.float64) * 32768.0), -32768, 32767)
    return audio.astype("<i2").tobytes()


class SharedVoices:
    """The engine's cloned voices, kept equal to `store`'s. Every method runs on the server's event loop."""

    def __init__(self, engine: OrpheusEngine, store: VoiceStore | None = None, sync_s: float = SYNC_S):
        """`store`: the deployment's (default: this server's memory, shared with nobody)."""
        self.engine = engine
        self.store: VoiceStore = store if store is not None else MemoryVoiceStore()
        self.sync_s = sync_s
        self._held: dict[str, StoredVoice] = {}  # the voices this server added to its engine, by name
        self._tags: dict[str, str] = {}  # the store's tag of each held voice, as it was when added
        # Tags of stored voices this engine refused (e.g. one of its stock voices' names): not tried again.
        self._refused: dict[str, str] = {}
        self._epoch: str | None = None  # the store's, at the last sync
        self._lock = asyncio.Lock()  # one change at a time: an add, a removal or a sync
        self._last_error: str | None = None  # the last sync's failure, logged once
        self._stopping = asyncio.Event()  # set once by stop(): run() returns at its next step

    async def add(self, name: str, audio: np.ndarray, transcript: str) -> None:
        """Add a voice here, then to the store; TypeError/ValueError as `add_voice` (or the name taken on another
        server), VoiceStoreError if the store cannot take it (then it is not added here either)."""
        async with self._lock:
            await asyncio.to_thread(self.engine.add_voice, name, audio=audio, transcript=transcript)
            voice = StoredVoice(name, transcript, pcm16(audio))
            try:
                if self._epoch is None:  # the store's, before it holds a voice of ours: a later change means a loss
                    self._epoch = (await self._ask(self.store.listing()))[0]
                tag = await self._ask(self.store.put(voice))
            except BaseException:
                self.engine.remove_voice(name)
                raise
            self._held[name], self._tags[name] = voice, tag

    async def remove(self, name: str) -> None:
        """Remove a voice from the store and here; KeyError (naming the added voices) if neither had it."""
        async with self._lock:
            stored = await self._ask(self.store.remove(name))
            self._forget(name)
            try:
                self.engine.remove_voice(name)
            except KeyError:
                if not stored:
                    raise

    async def knows(self, voice: str | None) -> None:
        """Before a stream: a voice the engine does not know may have been added on another server since the last
        sync; sync now (VoiceStoreError if the store cannot be asked)."""
        if voice is None or voice in self.engine.spec.voices:
            return
        async with self._lock:
            if voice not in self.engine.spec.voices:
                await self._sync()

    async def sync(self) -> None:
        """Add the store's new voices to the engine and drop those it no longer holds."""
        async with self._lock:
            await self._sync()

    async def run(self) -> None:
        """Sync every `sync_s` until stop(); a store that cannot be reached is logged once and retried.

        It checks stop()'s flag after every await rather than relying on cancellation alone: Python 3.11's
        `asyncio.wait_for` drops a cancel that arrives as its awaitable finishes (a store that answers at once), and
        the server's shutdown then waited for this loop for ever."""
        while not self._stopping.is_set():
            try:
                await self.sync()
                self._last_error = None
            except VoiceStoreError as exc:
                if str(exc) != self._last_error:
                    log.warning("cloned voices not synced: %s", exc)
                self._last_error = str(exc)
            except Exception:  # noqa: BLE001 - a bug here must not end the syncing for the server's life
                log.exception("cloned voices not synced")
            with contextlib.suppress(asyncio.TimeoutError):  # the period, cut short by stop()
                await asyncio.wait_for(self._stopping.wait(), self.sync_s)

    def stop(self) -> None:
        """End run() at its next step (the server is shutting down)."""
        self._stopping.set()

    async def _sync(self) -> None:
        epoch, tags = await self._ask(self.store.listing())
        if self._epoch is not None and epoch != self._epoch:  # the store lost what it held: give back ours
            for name, voice in self._held.items():
                with contextlib.suppress(ValueError):  # another server gave it back first
                    self._tags[name] = await self._ask(self.store.put(voice))
            epoch, tags = await self._ask(self.store.listing())
        self._epoch = epoch
        self._refused = {name: tag for name, tag in self._refused.items() if tags.get(name) == tag}
        for name in [n for n in self._held if tags.get(n) != self._tags[n]]:  # removed, or replaced
            self._forget(name)
            with contextlib.suppress(KeyError):
                self.engine.remove_voice(name)
        for name in sorted(set(tags) - set(self._held) - set(self._refused)):
            voice = await self._ask(self.store.get(name))
            if voice is None:  # removed since the listing
                continue
            audio = np.frombuffer(voice.pcm, dtype="<i2")
            try:
                await asyncio.to_thread(self.engine.add_voice, name, audio=audio, transcript=voice.transcript)
            except (ValueError, TypeError) as exc:
                log.warning("stored voice %r not added here: %s", name, exc)
                self._refused[name] = tags[name]
                continue
            self._held[name], self._tags[name] = voice, tags[name]  # if replaced since the listing: the next sync

    def _forget(self, name: str) -> None:
        self._held.pop(name, None)
        self._tags.pop(name, None)
        self._refused.pop(name, None)

    async def _ask(self, call: Awaitable[T]) -> T:
        """The store's answer within STORE_TIMEOUT_S, else VoiceStoreError."""
        try:
            return await asyncio.wait_for(call, STORE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise VoiceStoreError(f"the voice store did not answer within {STORE_TIMEOUT_S:g} s") from None
