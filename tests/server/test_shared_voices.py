"""`SharedVoices` on one engine and a store: a stream naming a voice added elsewhere since the last sync syncs at
once, a voice replaced under its name elsewhere is replaced here, a store that lost everything gets its voices back
from the servers, a store that cannot take a voice leaves the engine without it, and a folder store's files appear
whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin.server.shared_voices import SharedVoices, pcm16
from orpheus_tts_plugin.server.voice_store import (
    DirectoryVoiceStore,
    MemoryVoiceStore,
    StoredVoice,
    VoiceStoreError,
)
from orpheus_tts_plugin.spec import SAMPLE_RATE

TRANSCRIPT = "This is how I sound."
PCM = (3000 * np.random.default_rng(0).standard_normal(SAMPLE_RATE // 2)).astype("<i2")


@pytest.fixture
async def engine(synthetic_config: EngineConfig) -> AsyncIterator[OrpheusEngine]:
    engine = OrpheusEngine(synthetic_config)
    await engine.start()
    yield engine
    await engine.aclose()


class Unreachable(MemoryVoiceStore):
    async def put(self, voice: StoredVoice) -> None:
        raise VoiceStoreError("the voice store is unreachable")


async def test_a_stream_naming_a_voice_added_elsewhere_syncs_at_once_and_a_replacement_and_a_removal_reach_it(
    engine: OrpheusEngine,
) -> None:
    store = MemoryVoiceStore()
    voices = SharedVoices(engine, store)
    await voices.sync()
    await store.put(StoredVoice("elsewhere", TRANSCRIPT, PCM.tobytes()))  # another server's add
    await voices.knows("elsewhere")
    assert "elsewhere" in engine.spec.voices
    await voices.knows("nobody")  # unknown everywhere: the engine refuses it, as before
    assert "nobody" not in engine.spec.voices
    await store.remove("elsewhere")  # replaced on another server, within one sync period: another reference
    await store.put(StoredVoice("elsewhere", "Another take.", PCM[::-1].tobytes()))
    await voices.sync()
    assert [v["transcript"] for v in engine.voices() if v["name"] == "elsewhere"] == ["Another take."]
    await store.remove("elsewhere")  # another server's removal
    await voices.sync()
    assert "elsewhere" not in engine.spec.voices


async def test_a_store_that_lost_everything_gets_the_voices_back_from_the_servers(engine: OrpheusEngine) -> None:
    store = MemoryVoiceStore()
    voices = SharedVoices(engine, store)
    await voices.add("mine", PCM, TRANSCRIPT)
    store.lose_everything()  # a registry restarted on another node
    await voices.sync()
    assert "mine" in engine.spec.voices and await store.get("mine") == StoredVoice("mine", TRANSCRIPT, PCM.tobytes())


async def test_a_voice_the_store_cannot_take_is_not_kept_by_the_engine(engine: OrpheusEngine) -> None:
    voices = SharedVoices(engine, Unreachable())
    with pytest.raises(VoiceStoreError, match="unreachable"):
        await voices.add("mine", PCM, TRANSCRIPT)
    assert "mine" not in engine.spec.voices


async def test_a_folder_store_keeps_whole_files_refuses_a_taken_name_and_float_audio_round_trips(
    tmp_path: Path,
) -> None:
    store = DirectoryVoiceStore(tmp_path / "voices")
    voice = StoredVoice("mine", TRANSCRIPT, pcm16(PCM.astype(np.float32) / 32768.0))
    assert voice.pcm == PCM.tobytes()
    await store.put(voice)
    with pytest.raises(ValueError, match="'mine' is already added"):
        await DirectoryVoiceStore(tmp_path / "voices").put(voice)
    assert [p.name for p in (tmp_path / "voices").iterdir()] == ["mine.voice.json"]  # nothing left aside
    assert await store.get("mine") == voice and set((await store.listing())[1]) == {"mine"}
    assert await store.remove("mine") and not await store.remove("mine")
    (tmp_path / "a-file").touch()
    with pytest.raises(ValueError, match="cannot be created"):
        DirectoryVoiceStore(tmp_path / "a-file" / "voices")
