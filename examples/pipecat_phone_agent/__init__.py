"""A Pipecat phone agent (Twilio Media Streams) that speaks with Orpheus TTS in-process, plus a simulated caller."""
