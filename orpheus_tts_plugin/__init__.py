"""Orpheus TTS inside a voice agent's process."""
