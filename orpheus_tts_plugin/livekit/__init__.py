"""LiveKit Agents adapter: the Orpheus `tts.TTS` (`tts`) and the worker set-up (`worker`: one engine per worker
process, its load reported to LiveKit, the `OrpheusPlugin` registered on import).

May import: root, speech, engine, client. (And LiveKit Agents.)
"""

from __future__ import annotations

from ..types import SpeechEngine
from .tts import TTS, ChunkedStream, SynthesizeStream
from .worker import OrpheusPlugin, download_files, engine_load_fnc, prewarm_engine, remote_engine, server_options

__all__ = [
    "TTS",
    "ChunkedStream",
    "OrpheusPlugin",
    "SynthesizeStream",
    "download_files",
    "engine_load_fnc",
    "prewarm_engine",
    "remote_engine",
    "server_options",
    "SpeechEngine",
]
