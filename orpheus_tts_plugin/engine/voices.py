"""The engine's voices: its model family's, its fine-tuned ones, and the cloned ones added while it runs
(`speech.voices` checks and encodes them; this is where the engine keeps and serves them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..spec import ModelSpec, spec_for, with_voices
from ..speech.voices import Voices

if TYPE_CHECKING:
    import numpy as np


class EngineVoices:
    """`OrpheusEngine`'s voices and the SNAC encoder that clones them (a mixin)."""

    def _init_voices(self) -> None:
        # Its voices: the family's, the fine-tuned ones (`adapter_voices`), then those added (`add_voice`).
        self.spec: ModelSpec = with_voices(spec_for(self.config.model_family), dict(self.config.adapter_voices))
        self._voices = Voices(self.spec)
        self._snac: Any = None  # the SNAC whose encoder encodes added voices (the decoder's, once started)

    def add_voice(self, name: str, *, audio: str | Path | np.ndarray, transcript: str) -> None:
        """Add a cloned voice: `synthesize(text, voice=name)` then speaks in the voice of `audio` (zero-shot).

        `audio`: a 16-bit WAV file at 24 kHz, or a 1-D float (in [-1, 1]) or int16 array at 24 kHz, one frame
        (2,048 samples) to 30 s; `transcript`: the words it speaks. The reference is encoded once with SNAC's
        encoder and becomes the reference turn of every prompt of this voice (`prompt.reference_prompt`), a
        prefix the backend computes once (hf: its prefix store; vLLM and TensorRT-LLM: their prefix caching).
        Before `start()` it is only checked (encoded when the engine starts); after, it is encoded now, on the
        calling thread (a server runs this in a worker thread). TypeError/ValueError in one line for bad input.
        """
        voice = self._voices.check(name, audio, transcript, self.config.max_seq_len)
        if self.started:
            self._voices.encode(voice, self._tokenizer, self._encoder)
        self.spec = self._voices.add(voice)

    def remove_voice(self, name: str) -> None:
        """Remove an added voice (KeyError if `name` is not one) and free its reference's cached prefix."""
        voice, self.spec = self._voices.remove(name)
        forget = getattr(self._backend, "forget_prefix", None)
        if voice.reference is not None and forget is not None:
            forget(voice.reference)

    def voices(self) -> list[dict[str, Any]]:
        """Every voice: {"name", "kind": "stock"}, then each added one's {"name", "kind": "cloned", "seconds",
        "transcript", "prompt_ids" (its reference turn's length, None until encoded)}."""
        return self._voices.describe()

    def _reference(self, voice: str | None) -> tuple[int, ...]:
        """The reference turn a prompt in `voice` starts with: a cloned voice's (encoded now if not yet), else ()."""
        cloned = self._voices.get(voice)
        return () if cloned is None else self._voices.encode(cloned, self._tokenizer, self._encoder)

    def _encoder(self) -> Any:
        """The SNAC that encodes references: the decoder's, else (a null decoder) `config.snac`, loaded once."""
        if self._snac is None:
            from ..codec.snac import load_snac
            from .device import resolve_device

            self._snac = load_snac(self.config.snac, resolve_device(self.config.device))
        return self._snac
