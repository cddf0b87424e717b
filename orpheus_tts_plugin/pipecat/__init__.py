"""Pipecat adapter: `OrpheusTTSService` (`tts`) with its health (`health`) and settings (`settings`), and the
turn strategy that speaks ahead of a confirmed turn (`turns`).

May import: root, speech, engine. (And Pipecat.)
"""

from __future__ import annotations

from .settings import OrpheusTTSSettings
from .tts import FirstPhraseTextAggregator, OrpheusTTSService
from .turns import ReplyHoldFrame, ReplyReleaseFrame, SpeakAheadUserTurnStopStrategy

__all__ = [
    "FirstPhraseTextAggregator",
    "OrpheusTTSService",
    "OrpheusTTSSettings",
    "ReplyHoldFrame",
    "ReplyReleaseFrame",
    "SpeakAheadUserTurnStopStrategy",
]
