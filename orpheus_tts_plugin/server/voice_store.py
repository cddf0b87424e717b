"""Where a deployment's cloned voices live, so that a voice added on one server is spoken by all (`voice_sync`).

A store holds each voice's source (name, transcript, 16-bit PCM at 24 kHz), not its encoded reference turn: each
server encodes it with its own SNAC and tokenizer, which a rollout may change. Two stores here: `MemoryVoiceStore`
(one server on its own, the default) and `DirectoryVoiceStore` (`serve --voices-dir`: servers sharing a folder, on
one machine or on a shared volume); `ray_voices.RayVoiceStore` is the Ray Serve deployment's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import EngineError

SUFFIX = ".voice.json"
T = TypeVar("T")


class VoiceStoreError(EngineError):
    """The store cannot be read or written now (a folder gone, a registry unreachable): retry later."""


@dataclass(frozen=True)
class StoredVoice:
    """A cloned voice as a store keeps it: what `add_voice` needs to make it again on any server."""

    name: str
    transcript: str
    pcm: bytes  # int16 little-endian mono at 24 kHz

    def record(self) -> dict[str, str]:
        return {"name": self.name, "transcript": self.transcript, "pcm": base64.b64encode(self.pcm).decode()}

    @classmethod
    def of_record(cls, record: dict[str, str]) -> StoredVoice:
        return cls(record["name"], record["transcript"], base64.b64decode(record["pcm"], validate=True))


class VoiceStore(Protocol):
    """A deployment's cloned voices. Every method is called on the server's event loop; VoiceStoreError when the
    store cannot answer."""

    async def listing(self) -> tuple[str, dict[str, str]]:
        """(the store's epoch, each voice's tag by name). A tag changes when a voice is replaced under its name
        (removed and added again). The epoch changes only when the store lost what it held (a registry restarted
        empty): the servers then put back the voices they hold."""
        ...

    async def get(self, name: str) -> StoredVoice | None:
        """The voice of that name, or None if there is none (any more)."""
        ...

    async def put(self, voice: StoredVoice) -> str:
        """Keep `voice`, and its tag; ValueError if the store holds a voice of that name already (added elsewhere)."""
        ...

    async def remove(self, name: str) -> bool:
        """Drop the voice of that name; whether there was one."""
        ...


def taken(name: str) -> ValueError:
    return ValueError(f"voice {name!r} is already added; remove_voice({name!r}) first to replace it")


class MemoryVoiceStore:
    """The voices of one server alone, in its memory (the default: nothing to share them with)."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self._voices: dict[str, tuple[StoredVoice, str]] = {}  # (voice, tag) by name; server loop only

    async def listing(self) -> tuple[str, dict[str, str]]:
        return self.epoch, {name: tag for name, (_, tag) in self._voices.items()}

    async def get(self, name: str) -> StoredVoice | None:
        return self._voices[name][0] if name in self._voices else None

    async def put(self, voice: StoredVoice) -> str:
        if voice.name in self._voices:
            raise taken(voice.name)
        tag = uuid.uuid4().hex
        self._voices[voice.name] = (voice, tag)
        return tag

    async def remove(self, name: str) -> bool:
        return self._voices.pop(name, None) is not None

    def lose_everything(self) -> None:
        """Forget every voice under a new epoch, as a registry that restarted (for tests of the put-back)."""
        self.epoch = uuid.uuid4().hex
        self._voices.clear()


def tag_of(stat: os.stat_result) -> str:
    """A voice file's tag: a file written again under its name has another (its inode, time or size differ)."""
    return f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}"


class DirectoryVoiceStore:
    """One JSON file a voice (`NAME.voice.json`) in a folder that every server of the deployment mounts.

    A file appears whole or not at all (written aside, then linked into place, which also refuses a name taken
    by another server at the same moment). File work runs in a worker thread: a network volume may be slow.
    """

    def __init__(self, path: str | os.PathLike[str]):
        """`path`: the folder, created if missing; ValueError in one line if it cannot be."""
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"voices directory {str(path)!r} cannot be created: {exc.strerror}") from None
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise ValueError(f"voices directory {str(path)!r} is not readable and writable")

    async def listing(self) -> tuple[str, dict[str, str]]:
        return "directory", await self._run(self._tags)

    async def get(self, name: str) -> StoredVoice | None:
        return await self._run(self._read, name)

    async def put(self, voice: StoredVoice) -> str:
        return await self._run(self._write, voice)

    async def remove(self, name: str) -> bool:
        return await self._run(self._unlink, name)

    async def _run(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(work, *args)
        except OSError as exc:
            raise VoiceStoreError(f"voices directory {str(self.path)!r}: {exc.strerror or exc}") from None

    def _file(self, name: str) -> Path:
        return self.path / (name + SUFFIX)

    def _tags(self) -> dict[str, str]:
        tags = {}
        for entry in os.scandir(self.path):
            if entry.name.endswith(SUFFIX):
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    tags[entry.name[: -len(SUFFIX)]] = tag_of(entry.stat())
        return tags

    def _read(self, name: str) -> StoredVoice | None:
        try:
            text = self._file(name).read_text()
        except FileNotFoundError:
            return None
        try:
            return StoredVoice.of_record(json.loads(text))
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise VoiceStoreError(f"{self._file(name)} is not a voice file: {exc}") from None

    def _write(self, voice: StoredVoice) -> str:
        fd, aside = tempfile.mkstemp(dir=self.path, prefix=".incoming-")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(voice.record(), out)
            try:
                os.link(aside, self._file(voice.name))  # fails if the name is taken, even by a racing server
            except FileExistsError:
                raise taken(voice.name) from None
            return tag_of(os.stat(self._file(voice.name)))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(aside)

    def _unlink(self, name: str) -> bool:
        try:
            self._file(name).unlink()
        except FileNotFoundError:
            return False
        return True
