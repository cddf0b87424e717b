"""The sampler the hf backend's fast one replaced, kept for side-by-side benchmarks and as the tests' yardstick.

It computes all 28,673 audio logits (or the whole vocab), masks the frame position, sorts every row for the top-p
nucleus and draws by an exponential race: one torch generator per seeded row, one shared by the unseeded ones.
`ReferenceHFBackend` is HFBackend stepping eagerly through it (`bench backend` times it against the fast one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...backends.hf import HFBackend, Row
from ...backends.protocol import GenerationRequest
from ...spec import CODEBOOK_SIZE, TOKENS_PER_FRAME


def reference_penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The reference sampler's repetition penalty, unchanged (same values as `penalize`)."""
    penalty = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def reference_sample(
    logits: torch.Tensor,
    temperature: list[float],
    top_p: list[float],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> torch.Tensor:
    """The sampler `backends.sampling` replaced, unchanged: softmax, full sort + cumsum, exponential race per row."""
    dev = logits.device
    chosen = logits.argmax(-1)
    if any(t > 0 for t in temperature):
        temp = torch.tensor(temperature, device=dev)
        probs = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)
        if any(p < 1.0 for p in top_p):
            sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > torch.tensor(top_p, device=dev)[:, None]
            probs = torch.zeros_like(probs).scatter_(-1, sorted_i, sorted_p.masked_fill(drop, 0.0))
        # Exponential race (argmax of p / Exp(1)) samples from p; one generator per seeded row.
        race = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        for i, g in enumerate(generators):
            if g is not None:
                race[i].exponential_(generator=g)
        if unseeded:
            noise = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(generator=shared)
            race[torch.tensor(unseeded, device=dev)] = noise
        chosen = torch.where(temp > 0, (probs / race).argmax(-1), chosen)
    return chosen


class ReferenceHFBackend(HFBackend):
    """HFBackend whose rows the reference sampler draws: eager steps over the audio ids or the vocab, no graphs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.static_shapes:
            raise ValueError("the reference sampler steps eagerly: no static_shapes or cuda_graphs")
        self._decode_rows = self._decode_reference
        # Filled by _load and _admit, owned by the stepping thread.
        self.audio_ids = torch.empty(0)  # sub-vocab j < 7*4096 is id first_audio_token + j, then end of speech
        self.audio_phase = torch.empty(0)  # frame position of each sub-vocab id (end of speech: 0)
        self.generators: list[torch.Generator | None] = [None] * self.max_batch_size  # per slot: seeded requests
        self.shared_generator = torch.Generator()  # the unseeded rows' (on the device once loaded)

    @torch.inference_mode()
    def _load(self) -> None:
        """HFBackend's model and tables, then the audio-only head's ids and positions and the shared generator."""
        super()._load()
        n_audio = TOKENS_PER_FRAME * CODEBOOK_SIZE
        self.audio_ids = torch.tensor(self.spec.audio_ids, device=self.device)
        self.audio_phase = torch.cat([torch.arange(n_audio) // CODEBOOK_SIZE, torch.tensor([0])]).to(self.device)
        self.shared_generator = torch.Generator(self.device)
        self.shared_generator.seed()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, audio_only: bool = False) -> torch.Tensor:
        """float32 logits of hidden (..., D): over the whole vocab, or over `audio_ids` only (same values)."""
        if not audio_only:
            return super().logits(hidden)
        w, lo, eos = self.model.lm_head.weight, self.spec.first_audio_token, self.spec.end_of_speech
        audio = F.linear(hidden, w[lo : lo + len(self.audio_ids) - 1])
        return torch.cat([audio, F.linear(hidden, w[eos : eos + 1])], dim=-1).float()

    def _admit(self, req: GenerationRequest) -> Row:
        """HFBackend's admission, and a generator of the request's own where it is seeded."""
        row = super()._admit(req)
        seed = req.sampling.seed
        self.generators[row.slot] = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        return row

    def _decode_reference(self, rows: list[Row]) -> list[int]:
        """Forward, then the reference sampler over all 28,673 audio ids (or the vocab); the chosen ids."""
        slots = [r.slot for r in rows]
        ids = torch.tensor([[r.last] for r in rows], device=self.device)
        hidden = self.forward(ids, slots, [r.pos for r in rows])[:, -1]
        new = torch.empty(len(rows), dtype=torch.long, device=self.device)
        for audio_only in (True, False):
            group = [i for i, r in enumerate(rows) if r.req.constrain_audio == audio_only]
            if group:
                idx = torch.tensor(group, device=self.device)
                new[idx] = self._sample_reference(hidden[idx], [rows[i] for i in group], audio_only)
        self.seen[torch.tensor(slots, device=self.device), new] = True
        return new.tolist()

    def _sample_reference(self, hidden: torch.Tensor, rows: list[Row], audio_only: bool) -> torch.Tensor:
        """Next id per row: repetition penalty, phase mask (audio_only), temperature (0: greedy), top-p."""
        dev = self.device
        logits = self.logits(hidden, audio_only=audio_only)
        seen = self.seen[torch.tensor([r.slot for r in rows], device=dev)]
        if audio_only:
            seen = seen[:, self.audio_ids]
        penalty = torch.tensor([r.req.sampling.repetition_penalty for r in rows], device=dev)
        logits = reference_penalize(logits, seen, penalty)
        if audio_only:
            phase = torch.tensor([r.generated % TOKENS_PER_FRAME for r in rows], device=dev)
            logits = logits.masked_fill(self.audio_phase[None, :] != phase[:, None], float("-inf"))
        s = [r.req.sampling for r in rows]
        generators = [self.generators[r.slot] for r in rows]
        chosen = reference_sample(
            logits, [x.temperature for x in s], [x.top_p for x in s], generators, self.shared_generator
        )
        return self.audio_ids[chosen] if audio_only else chosen
