"""A model-free backend: valid audio token ids at a set rate, for overhead benchmarks and fast tests."""

from __future__ import annotations

import time
import zlib
from typing import Any

import numpy as np

from ..config import SyntheticConfig
from ..spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME, ModelSpec
from .protocol import FinishReason, GenerationRequest
from .stepped import SteppedBackend


class SyntheticBackend(SteppedBackend):
    """One engine step emits one valid audio id per live request, then the end-of-speech id."""

    name = "synthetic"

    def __init__(self, config: SyntheticConfig | None = None, spec: ModelSpec = ENGLISH, max_batch_size: int = 1024):
        super().__init__(max_batch_size=max_batch_size)
        self.config = config or SyntheticConfig()
        self.spec = spec
        self._next_step = 0.0

    def _admit(self, req: GenerationRequest) -> dict[str, Any]:
        text_ids = len(req.prompt_ids) - req.prefix_len  # a cloned voice's reference turn is not what it says
        frames = max(self.config.min_frames, round(text_ids * self.config.frames_per_prompt_token))
        seed = req.sampling.seed if req.sampling.seed is not None else zlib.crc32(req.request_id.encode())
        codes = np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, size=frames * TOKENS_PER_FRAME)
        positions = np.arange(codes.size) % TOKENS_PER_FRAME
        ids = (self.spec.first_audio_token + positions * CODEBOOK_SIZE + codes).tolist()
        if self.config.fault_every > 0:
            for i in range(self.config.fault_every - 1, len(ids), self.config.fault_every):
                ids[i] = self.spec.pad
        if not self.config.endless:
            ids.append(self.spec.end_of_speech)
        return {"ids": ids, "i": 0, "limit": req.max_new_tokens, "stop": set(req.stop_ids)}

    def _step(self, states: list[dict[str, Any]]) -> list[tuple[list[int], str | None]]:
        self._pace()
        out: list[tuple[list[int], str | None]] = []
        for st in states:
            token = st["ids"][st["i"] % len(st["ids"])]  # endless ids repeat whole frames
            st["i"] += 1
            if token in st["stop"]:
                out.append(([], FinishReason.STOP))
            elif st["i"] >= st["limit"]:
                out.append(([token], FinishReason.LENGTH))
            else:
                out.append(([token], None))
        return out

    def _pace(self) -> None:
        """Sleep until the next step is due, holding the configured per-stream token rate."""
        rate = self.config.tokens_per_second
        if rate <= 0:
            return
        now = time.perf_counter()
        if self._next_step < now - 1.0 / rate:
            self._next_step = now
        delay = self._next_step - now
        if delay > 0:
            time.sleep(delay)
        self._next_step += 1.0 / rate
