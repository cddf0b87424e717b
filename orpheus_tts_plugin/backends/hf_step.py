"""The hf backend's engine step: one batched decode forward over the live rows and one sampled id per row, eager
or at static shapes (batch and length buckets) and then replayed from captured CUDA graphs.

A layer of HFBackend (hf.py), over its rows (hf_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..spec import TOKENS_PER_FRAME
from .hf_rows import HFRows, Row
from .protocol import FinishReason
from .sampling import penalize, sample, uniforms


def step_buckets(max_batch_size: int, max_seq_len: int, batch_invariant: bool) -> tuple[tuple[int, ...], ...]:
    """The cache rows and the keys a static step covers: (batch buckets, length buckets)."""
    rows, keys = _buckets(max_batch_size), _buckets(max_seq_len, start=min(64, max_seq_len))
    if batch_invariant:  # one shape for every step: the largest
        return rows[-1:], keys[-1:]
    return rows, keys


def _buckets(top: int, start: int = 1) -> tuple[int, ...]:
    """Buckets: start, doubling while below top, then top."""
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


class HFStep(HFRows):
    """`_step`: decode every live row one id, by the eager step or the static one (replayed where captured)."""

    def _init_step(self) -> None:
        # How a step decodes its rows, chosen once: the static step where shapes are static, else the eager one.
        self._decode_rows: Callable[[list[Row]], list[int]] = (
            self._decode_static if self.static_shapes else self._decode
        )
        # Filled by _capture_graphs and owned by the stepping thread from then on (close() drops them once that
        # has ended).
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def _step(self, states: list[Row]) -> list[tuple[list[int], str | None]]:
        """One batched decode forward over every live row, then sampling; new ids and finish reasons."""
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        rows = [states[i] for i in order]
        new = self._decode_rows(rows)
        max_seq_len = self.max_seq_len
        out: list[tuple[list[int], str | None]] = [([], None)] * len(rows)
        for i, (row, tok) in enumerate(zip(rows, new, strict=True)):
            row.pos += 1
            row.generated += 1
            row.last = tok
            if tok in row.stop_ids:
                out[order[i]] = ([], FinishReason.STOP)
            elif row.generated >= row.req.max_new_tokens or row.pos + 1 >= max_seq_len:
                out[order[i]] = ([tok], FinishReason.LENGTH)
            else:
                out[order[i]] = ([tok], None)
        return out

    # -- the eager step --
    def _decode(self, rows: list[Row]) -> list[int]:
        """Forward and sample the rows (ascending slots) as they are, no padding; the chosen ids."""
        meta = torch.tensor([[r.slot, r.pos, r.last, r.generated] for r in rows], device=self.device)
        slots, pos, last, count = meta.unbind(1)
        length = max(r.pos for r in rows) + 1
        hidden = self._forward(last[:, None], slots, pos[:, None], rows[0].slot, rows[-1].slot + 1, length)[:, -1]
        audio = [i for i, r in enumerate(rows) if r.req.constrain_audio]
        if len(audio) == len(rows):
            return self._sample_audio(hidden, slots, count, self._phases(rows)).tolist()
        new = torch.empty(len(rows), dtype=torch.long, device=self.device)
        text = [i for i, r in enumerate(rows) if not r.req.constrain_audio]
        if audio:
            a = torch.tensor(audio, device=self.device)
            new[a] = self._sample_audio(hidden[a], slots[a], count[a], self._phases([rows[i] for i in audio]))
        t = torch.tensor(text, device=self.device)
        new[t] = self._sample_text(hidden[t], slots[t], count[t])
        return new.tolist()

    def _phases(self, rows: list[Row]) -> list[int] | None:
        """The rows' frame positions for a head product per position (CPU); None: one product for all (CUDA)."""
        return None if self.branch_free else [r.generated % TOKENS_PER_FRAME for r in rows]

    def _sample_audio(
        self, hidden: torch.Tensor, slots: torch.Tensor, count: torch.Tensor, phases: list[int] | None = None
    ) -> torch.Tensor:
        """Next id of audio rows: their frame position's logits, per-slot penalty, the fast sampler."""
        phase = count % TOKENS_PER_FRAME
        logits = self.phase_logits(hidden, phase, phases, masked=False)
        col = self._choose(logits, self.audio_seen[slots, phase], slots, count, self.eos_bias[phase])
        self.audio_seen[slots, phase, col] = 1.0
        return self.col_ids[phase, col]

    def _sample_text(self, hidden: torch.Tensor, slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Next id of unconstrained rows: whole-vocab logits, per-slot penalty by id, the fast sampler."""
        ids = self._choose(self.logits(hidden), self.seen[slots], slots, count)
        self.seen[slots, ids] = True
        return ids

    def _choose(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor,
        slots: torch.Tensor,
        count: torch.Tensor,
        eos_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Column per row: the slot's penalty, `eos_bias` (-inf: end of speech not allowed here) on the last
        column, the slot's temperature and top-p, the row's own uniform."""
        temperature, top_p, penalty = self.slot_sampling[slots].unbind(1)
        logits = penalize(logits, seen, penalty)
        if eos_bias is not None:
            logits[:, -1] += eos_bias
        u = uniforms(self.slot_seed[slots], count)
        return sample(logits, temperature, top_p, u, self.top_k, self.branch_free)

    # -- static shapes and CUDA graphs --
    def _bucket(self, rows: int) -> int:
        """The smallest batch bucket that holds `rows` cache rows."""
        return next(b for b in self.buckets if b >= rows)

    def _length_bucket(self, keys: int) -> int:
        """The smallest attention length bucket that holds `keys` cache positions."""
        return next(b for b in self.length_buckets if b >= keys)

    def _decode_static(self, rows: list[Row]) -> list[int]:
        """Forward and sample the cache window [0, bucket), rows without a request padded inactive; chosen ids.

        Its shapes cover audio rows only: a step with an unconstrained row (the whole vocab) runs eagerly."""
        if not all(r.req.constrain_audio for r in rows):
            return self._decode(rows)
        length, host = self._static_meta(rows)
        graph = self._graphs.get((host.shape[0], length))
        if graph is not None:
            replay, static_in, static_out = graph
            static_in.copy_(host, non_blocking=True)
            replay.replay()
            ids = static_out.tolist()
        else:
            ids = self._static_step(host.to(self.device), length).tolist()
        return [ids[r.slot] for r in rows]

    def _padding_meta(self) -> list[int]:
        """Step input of a padding row: it writes its key and value at the last cache position, which no live
        row ever reaches (a row ends at pos + 1 == max_seq_len), as its slot may hold a paused live row."""
        return [self.max_seq_len - 1, self.spec.pad, 0, 0]

    def _static_meta(self, rows: list[Row]) -> tuple[int, torch.Tensor]:
        """The rows' length bucket, and the step input of their batch bucket: pos, last id, count, active per row."""
        meta = [self._padding_meta()] * self._bucket(rows[-1].slot + 1)
        for r in rows:
            meta[r.slot] = [r.pos, r.last, r.generated, 1]
        return self._length_bucket(max(r.pos for r in rows) + 1), torch.tensor(meta)

    @torch.inference_mode()
    def _static_step(self, meta: torch.Tensor, length: int) -> torch.Tensor:
        """The step graphs capture: meta (bucket, 4) of pos, last, count, active per cache row, attending over
        `length` keys; the ids (bucket,)."""
        bucket = meta.shape[0]
        pos, last, count, active = meta.unbind(1)
        slots = torch.arange(bucket, device=self.device)
        hidden = self._forward(last[:, None], slots, pos[:, None], 0, bucket, length)[:, -1]
        phase = count % TOKENS_PER_FRAME
        logits = self.phase_logits(hidden, phase, masked=False)
        col = self._choose(logits, self.audio_seen[slots, phase], slots, count, self.eos_bias[phase])
        seen = self.audio_seen[slots, phase, col]
        self.audio_seen[slots, phase, col] = torch.maximum(seen, active.to(seen.dtype))  # padding rows: unchanged
        return self.col_ids[phase, col]

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """One CUDA graph of `_static_step` per (batch, length) bucket, largest first, one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            static_in = torch.tensor([self._padding_meta()] * bucket, device=self.device)  # all inactive
            for length in sorted(self.length_buckets, reverse=True):
                warm = torch.cuda.Stream(self.device)
                warm.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(warm):
                    for _ in range(2):  # allocator and cuBLAS workspaces, outside the capture
                        self._static_step(static_in, length)
                torch.cuda.current_stream(self.device).wait_stream(warm)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    static_out = self._static_step(static_in, length)
                self._graphs[bucket, length] = (graph, static_in, static_out)
        torch.cuda.synchronize(self.device)
