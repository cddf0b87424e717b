"""`orpheus-tts bench`: figures reported side by side in one run, never pass/fail."""
