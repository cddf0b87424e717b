"""The hf backend's rows: a request's admission into a free KV slot (checks, prefill, the slot's sampling state),
the per-slot tables its sampling reads (penalties, temperature / top-p / penalty, seed), and the slot's release.

A layer of HFBackend (hf.py), over its prefill (hf_prefill.py).
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass

import torch

from ..spec import CODEBOOK_SIZE, TOKENS_PER_FRAME
from .hf_model import COLUMNS, UNLOADED
from .hf_prefill import HFPrefill
from .protocol import GenerationRequest


@dataclass
class Row:
    """State of one live request: its KV cache slot and where it stands (stepping thread)."""

    req: GenerationRequest
    slot: int
    pos: int  # ids already in the KV cache
    last: int  # id fed at the next step (not yet in the cache)
    generated: int
    stop_ids: frozenset[int]
    seed: int  # counter-based draws: uniform k of this row = hash(seed, k)


class HFRows(HFPrefill):
    """Slots of the batch: which are free, each one's sampling state, admission and release of a request."""

    def _init_rows(self) -> None:
        # Owned by the stepping thread; the tables are filled by _allocate_rows.
        self.free_slots = list(range(self.max_batch_size))  # a heap: the lowest free slot is taken first
        self.seen = UNLOADED  # (slot, vocab) bool: ids seen, for the penalty of unconstrained rows
        self.audio_seen = UNLOADED  # (slot, 7, 4097): 1.0 where the column was seen (floats: the penalty multiplies)
        self.slot_sampling = UNLOADED  # (slot, 3): temperature, top_p, repetition penalty
        self.slot_seed = UNLOADED  # (slot,): the seed of each slot's counter-based uniforms

    def _allocate_rows(self) -> None:
        """The per-slot sampling tables (after the model: the vocab's size)."""
        dev, n = self.device, self.max_batch_size
        self.seen = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=dev)
        self.audio_seen = torch.zeros(n, TOKENS_PER_FRAME, COLUMNS, device=dev)
        self.slot_sampling = torch.tensor([[0.0, 1.0, 1.0]] * n, device=dev)
        self.slot_seed = torch.zeros(n, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def _admit(self, req: GenerationRequest) -> Row:
        """Check the request, take a KV slot, prefill all but the last prompt id, reset the slot's sampling state."""
        ids = req.prompt_ids
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} ids does not fit max_seq_len {self.max_seq_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt id out of range [0, {self.vocab_size})")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        adapter = self._adapter_index(req.adapter)
        slot = heapq.heappop(self.free_slots)
        s = req.sampling
        seed = secrets.randbits(63) if s.seed is None else s.seed
        try:
            if self.lora is not None:
                self.slot_adapter[slot] = adapter
            self._prefill(slot, ids[:-1], req.prefix_len if self.prefix_reuse else 0, req.adapter)
            self._reset_slot(slot, ids, s.temperature, s.top_p, s.repetition_penalty, seed)
        except BaseException:
            heapq.heappush(self.free_slots, slot)
            raise
        return Row(req, slot, len(ids) - 1, ids[-1], 0, frozenset(req.stop_ids), seed)

    def _reset_slot(
        self, slot: int, prompt: tuple[int, ...], temperature: float, top_p: float, penalty: float, seed: int
    ) -> None:
        """A slot's penalty tables hold only its prompt's ids, its sampling row this request's parameters."""
        dev = self.device
        self.seen[slot] = False
        self.seen[slot, torch.tensor(prompt, device=dev)] = True
        self.audio_seen[slot] = 0.0
        cols = self._audio_columns(prompt)
        if cols:
            k, c = torch.tensor(cols, device=dev).T
            self.audio_seen[slot, k, c] = 1.0
        self.slot_sampling[slot] = torch.tensor([temperature, top_p, penalty], device=dev)
        self.slot_seed[slot] = seed

    def _audio_columns(self, ids: tuple[int, ...]) -> list[tuple[int, int]]:
        """(frame position, column) of each distinct id that is an audio id or end of speech."""
        lo, eos, out = self.spec.first_audio_token, self.spec.end_of_speech, []
        for i in set(ids):
            if lo <= i < lo + TOKENS_PER_FRAME * CODEBOOK_SIZE:
                out.append(divmod(i - lo, CODEBOOK_SIZE))
            elif i == eos:
                out.extend((k, CODEBOOK_SIZE) for k in range(TOKENS_PER_FRAME))
        return out

    def _release(self, state: Row) -> None:
        """Give the request's KV slot back (its sampling state is reset when the slot is next taken)."""
        heapq.heappush(self.free_slots, state.slot)
