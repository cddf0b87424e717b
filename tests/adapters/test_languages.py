"""A `language` in Pipecat's settings and LiveKit's options (issue 22, part 3): it picks the voice of a language the
engine's model family speaks and is refused in one line otherwise; English engines behave as before."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest
from livekit.agents import LanguageCode
from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSUpdateSettingsFrame
from pipecat.tests.utils import run_test
from pipecat.transcriptions.language import Language

from orpheus_tts_plugin import EngineConfig, OrpheusEngine
from orpheus_tts_plugin import livekit as orpheus
from orpheus_tts_plugin.pipecat.tts import OrpheusTTSService

Settings = OrpheusTTSService.Settings


def _engine(config: EngineConfig, family: str) -> Iterator[OrpheusEngine]:
    engine = OrpheusEngine(replace(config, model_family=family))
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def es_it(synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    """The Spanish/Italian family: two languages, each with its own voices."""
    yield from _engine(synthetic_config, "orpheus-es_it")


@pytest.fixture(scope="module")
def english(synthetic_config: EngineConfig) -> Iterator[OrpheusEngine]:
    yield from _engine(synthetic_config, "orpheus-en")


# ---------------------------------------------------------------------------------------------- Pipecat
def test_pipecat_settings_start_in_the_familys_language_and_a_language_picks_its_voice(
    es_it: OrpheusEngine, english: OrpheusEngine
) -> None:
    assert (OrpheusTTSService(engine=english).settings.language, OrpheusTTSService(engine=english).settings.voice) == (
        Language.EN,
        "tara",
    )
    assert OrpheusTTSService(engine=es_it).settings.voice == "javi"
    italian = OrpheusTTSService(engine=es_it, settings=Settings(language=Language.IT_IT))
    assert italian.settings.voice == "pietro"
    chosen = OrpheusTTSService(engine=es_it, settings=Settings(language=Language.IT, voice="giulia"))
    assert chosen.settings.voice == "giulia"
    with pytest.raises(ValueError, match="'orpheus-en' does not speak 'fr'; it speaks: en"):
        OrpheusTTSService(engine=english, settings=Settings(language=Language.FR))


async def test_a_pipecat_language_update_switches_the_voice_and_an_unspoken_one_is_rejected(
    es_it: OrpheusEngine,
) -> None:
    service = OrpheusTTSService(engine=es_it, settings=Settings(seed=3, max_tokens=70))
    update = TTSUpdateSettingsFrame(delta=Settings(language=Language.IT))
    down, up = await run_test(
        service,
        frames_to_send=[
            update,
            TTSSpeakFrame("Ciao, come stai? Sto bene, grazie."),
            TTSUpdateSettingsFrame(delta=Settings(language=Language.DE)),
            TTSSpeakFrame("Ciao di nuovo."),
        ],
        start_timeout=60,
    )
    assert (service.settings.language, service.settings.voice) == (Language.IT, "pietro")
    assert update.delta.voice is not None and not isinstance(update.delta.voice, str)  # the caller's frame as it was
    [error] = [f for f in up if isinstance(f, ErrorFrame)]
    assert "rejected" in error.error and "does not speak 'de'" in error.error
    assert any(isinstance(f, TTSAudioRawFrame) for f in down)


# ---------------------------------------------------------------------------------------------- LiveKit
def test_livekit_language_picks_the_voice_at_construction(es_it: OrpheusEngine, english: OrpheusEngine) -> None:
    plain = orpheus.TTS(engine=english)
    assert (plain.language, plain.voice) == ("en", "tara")
    assert orpheus.TTS(engine=english, language="en-US", voice="leo").voice == "leo"
    assert (orpheus.TTS(engine=es_it).language, orpheus.TTS(engine=es_it).voice) == ("es", "javi")
    italian = orpheus.TTS(engine=es_it, language="italian")
    assert (italian.language, italian.voice) == (LanguageCode("it"), "pietro")
    with pytest.raises(ValueError, match="'orpheus-en' does not speak 'de'; it speaks: en"):
        orpheus.TTS(engine=english, language="de-DE")


async def test_livekit_update_options_language_switches_the_voice_for_later_requests(es_it: OrpheusEngine) -> None:
    tts = orpheus.TTS(engine=es_it, max_tokens=70)
    tts.update_options(language="it-IT")
    assert (tts.language, tts.voice) == ("it-IT", "pietro")
    assert [ev async for ev in tts.synthesize("Ciao, come stai?")]
    tts.update_options(voice="giulia")
    tts.update_options(language="it")  # a voice that speaks the language is kept
    assert tts.voice == "giulia"
    tts.update_options(language="es")  # one that does not gives way to the language's default
    assert tts.voice == "javi"
    tts.update_options(language="it", voice="carlo")
    assert tts.voice == "carlo"
    with pytest.raises(ValueError, match="does not speak 'fr'"):
        tts.update_options(language="fr")
    assert (tts.language, tts.voice) == ("it", "carlo")  # a refused update changes nothing
