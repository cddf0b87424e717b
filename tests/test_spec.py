"""The model family's spec: its voices."""

from __future__ import annotations

import pytest

from orpheus_tts_plugin.spec import ENGLISH


def test_unknown_voice_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="tara.*leah.*zoe"):
        ENGLISH.check_voice("nobody")
