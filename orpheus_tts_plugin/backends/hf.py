"""The portable default backend: a transformers Llama with our own continuous batching (gpt-fast style).

One static KV cache slot per live request; a new request is prefilled alone into its slot, then every
engine step runs one batched decode forward over all live rows (each at its own position) and samples
one id per row. The forward reuses the HF modules' weights, HF's rotary embedding (so llama3 RoPE
scaling is HF's) and SDPA with a per-row mask.

A row that is constrained to audio (the engine's default) computes only the logits its frame position can
take: the position's 4,096 codes and end of speech (`spec.allowed_ids`), a slice of lm_head. Its repetition
penalty reads a per-slot table over those columns, and `sampling.sample` draws the top-p nucleus without
sorting; one host sync per step (the chosen ids). `sampler="reference"` keeps the sampler this replaced
(all 28,673 audio logits, full sort), for side-by-side benchmarks.

Static shapes (`static_shapes=True`, implied by `cuda_graphs=True`): the decode step runs over the cache
window [0, bucket) with the bucket a power of two, padding rows inactive, attention over the whole cache
length and no data-dependent branch, so that on CUDA each bucket is captured once as a CUDA graph and
replayed (on CUDA by default: the eager step is launch-bound there). Padding never changes a row's tokens, nor a
paused row's state (tested on CPU); captured on an H200, 4.8-6.2 ms a step at 1-64 rows (docs/benchmarks.md).
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME, ModelSpec
from .protocol import FinishReason, GenerationRequest
from .sampling import penalize, reference_penalize, reference_sample, sample, uniforms
from .stepped import SteppedBackend

COLUMNS = CODEBOOK_SIZE + 1  # a frame position's sub-vocab: its 4,096 codes, then end of speech
SAMPLERS = ("fast", "reference")


@dataclass
class _Row:
    """State of one live request: its KV cache slot and where it stands (stepping thread)."""

    req: GenerationRequest
    slot: int
    pos: int  # ids already in the KV cache
    last: int  # id fed at the next step (not yet in the cache)
    generated: int
    stop_ids: frozenset[int]
    seed: int  # counter-based draws: uniform k of this row = hash(seed, k)
    generator: torch.Generator | None  # the reference sampler's per-row generator (seeded requests)


class HFBackend(SteppedBackend):
    """transformers `LlamaForCausalLM` + static KV cache + continuous batching, on CPU or CUDA."""

    name = "hf"

    def __init__(
        self,
        model: str | torch.nn.Module,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        max_seq_len: int = 4096,
        spec: ModelSpec = ENGLISH,
        sampler: str = "fast",
        top_k: int = 64,
        cuda_graphs: bool = False,
        static_shapes: bool | None = None,
    ):
        super().__init__(max_batch_size)
        if max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self._preloaded = None if isinstance(model, str) else model
        self.device = torch.device(device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, got {device!r}")
        self.static_shapes = cuda_graphs if static_shapes is None else static_shapes
        if self.static_shapes and sampler != "fast":
            raise ValueError("static_shapes and cuda_graphs need sampler='fast'")
        self.cuda_graphs = cuda_graphs
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_seq_len = max_seq_len
        self.spec = spec
        self.sampler = sampler
        self.top_k = top_k
        # CPU splits rows by sampling path (reading flags is free there); CUDA never branches on device data.
        self.branch_free = self.static_shapes or self.device.type == "cuda"
        self.model = None

    # -- model (everything below is owned by the stepping thread) --
    @torch.inference_mode()
    def _load(self) -> None:
        """Load the model, allocate the KV cache, the per-position head tables and the per-slot sampling state."""
        if self._preloaded is not None:
            model = self._preloaded.to(dtype=self.dtype)
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_name, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        cfg = self.model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (self.max_batch_size, cfg.num_key_value_heads, self.max_seq_len, self.head_dim)
        kw = {"dtype": self.dtype, "device": self.device}
        self.k_cache = [torch.zeros(shape, **kw) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, **kw) for _ in range(cfg.num_hidden_layers)]
        self.vocab_size = self.model.lm_head.weight.shape[0]
        self.free_slots = list(range(self.max_batch_size))
        self._build_head_tables()
        dev, n = self.device, self.max_batch_size
        self.seen = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=dev)  # by id: reference, unconstrained
        # By column, 1.0 where seen: floats, as the penalty multiplies by them.
        self.audio_seen = torch.zeros(n, TOKENS_PER_FRAME, COLUMNS, device=dev)
        self.slot_sampling = torch.tensor([[0.0, 1.0, 1.0]] * n, device=dev)  # temperature, top_p, penalty
        self.slot_seed = torch.zeros(n, dtype=torch.long, device=dev)
        self.shared_generator = torch.Generator(dev)
        self.shared_generator.seed()
        self.buckets = _buckets(self.max_batch_size)  # cache rows a static step covers
        self.length_buckets = _buckets(self.max_seq_len, start=min(64, self.max_seq_len))  # keys it attends over
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if self.cuda_graphs:
            self._capture_graphs()

    def _build_head_tables(self) -> None:
        """Column tables of each frame position from `spec.allowed_ids`, and the lm_head rows they read."""
        spec, eos = self.spec, self.spec.end_of_speech
        ids = np.full((TOKENS_PER_FRAME, COLUMNS), eos, dtype=np.int64)
        allowed = np.zeros((TOKENS_PER_FRAME, COLUMNS), dtype=bool)
        for k in range(TOKENS_PER_FRAME):
            valid = spec.allowed_ids(k)
            codes = valid[valid != eos]
            lo = spec.first_audio_token + k * CODEBOOK_SIZE
            if not np.array_equal(codes, np.arange(lo, lo + CODEBOOK_SIZE)):  # the head slices below rely on it
                raise ValueError(f"{spec.name}: codes of frame position {k} are not ids {lo}..{lo + CODEBOOK_SIZE - 1}")
            ids[k, :CODEBOOK_SIZE] = codes
            allowed[k, :CODEBOOK_SIZE] = True
            allowed[k, CODEBOOK_SIZE] = eos in valid
        self.col_ids = torch.from_numpy(ids).to(self.device)  # (7, 4097): id of each column at each position
        self.col_bias = torch.zeros(allowed.shape).masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        self.col_bias = self.col_bias.to(self.device)  # (7, 4097): 0 where allowed, else -inf
        self.eos_bias = self.col_bias[:, CODEBOOK_SIZE].contiguous()  # the only column that is ever -inf
        w, lo = self.model.lm_head.weight, spec.first_audio_token
        self.head_codes = w[lo : lo + TOKENS_PER_FRAME * CODEBOOK_SIZE]  # views: row k*4096 + c is code c at k
        self.head_eos = w[eos : eos + 1]
        # The reference sampler's audio-only head: sub-vocab j < 7*4096 is id first_audio_token + j, then eos.
        n_audio = TOKENS_PER_FRAME * CODEBOOK_SIZE
        self.audio_lo = lo
        self.audio_ids = torch.tensor(spec.audio_ids, device=self.device)
        self.audio_phase = torch.cat([torch.arange(n_audio) // CODEBOOK_SIZE, torch.tensor([0])]).to(self.device)

    def forward(self, ids: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """Run ids (n, T) at positions starts[i].. in KV slots[i] (ascending); the final hidden (n, T, D)."""
        n, T = ids.shape
        slots_t = torch.tensor(slots, device=self.device)
        pos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
        return self._forward(ids, slots_t, pos, slots[0], slots[-1] + 1, max(starts) + T)

    @torch.inference_mode()
    def _forward(
        self, ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, lo: int, hi: int, length: int
    ) -> torch.Tensor:
        """ids (n, T) at positions pos (n, T) in KV slots (ascending, in [lo, hi)), attending over `length` keys."""
        model = self.model.model
        n, T = ids.shape
        dev = self.device
        rows = slots - lo  # rows of the cache window [lo, hi)
        window = hi - lo
        dense = window == n
        mask = (torch.arange(length, device=dev) <= pos[:, :, None])[:, None]  # (n, 1, T, length)
        if not dense:  # attention runs over the whole cache window; rows with no request here see key 0 only
            mask = torch.zeros(window, 1, T, length, dtype=torch.bool, device=dev).index_copy_(0, rows, mask)
            mask[..., 0] = True

        x = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(x, pos)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, T, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(n, T, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(n, T, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[slots[:, None], :, pos] = k.transpose(1, 2)
            vc[slots[:, None], :, pos] = v.transpose(1, 2)
            if not dense:
                q = q.new_zeros(window, *q.shape[1:]).index_copy_(0, rows, q)
            kw, vw = kc[lo:hi, :, :length], vc[lo:hi, :, :length]
            o = F.scaled_dot_product_attention(q, kw, vw, attn_mask=mask, enable_gqa=True)
            if not dense:
                o = o[rows]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, audio_only: bool = False) -> torch.Tensor:
        """float32 logits of hidden (..., D): over the whole vocab, or over `audio_ids` only (same values)."""
        w = self.model.lm_head.weight
        if not audio_only:
            return self.model.lm_head(hidden).float()
        eos = self.spec.end_of_speech
        audio = F.linear(hidden, w[self.audio_lo : self.audio_lo + len(self.audio_ids) - 1])
        return torch.cat([audio, F.linear(hidden, w[eos : eos + 1])], dim=-1).float()

    @torch.inference_mode()
    def phase_logits(
        self, hidden: torch.Tensor, phase: torch.Tensor, phases: list[int] | None = None, masked: bool = True
    ) -> torch.Tensor:
        """float32 logits (n, 4097) of each row's frame position: its codes, then end of speech (masked: -inf where
        the position does not allow it).

        With `phases` (the same positions, on the host) one product per position present: a seventh of the
        work. Without, one product over all seven positions and a gather: static shapes, for graphs.
        """
        n = hidden.shape[0]
        eos = F.linear(hidden, self.head_eos)
        if phases is None:
            every = F.linear(hidden, self.head_codes).view(n, TOKENS_PER_FRAME, CODEBOOK_SIZE)
            codes = every.gather(1, phase[:, None, None].expand(n, 1, CODEBOOK_SIZE))[:, 0]
        elif len(set(phases)) == 1:
            codes = F.linear(hidden, self._head_at(phases[0]))
        else:
            codes = hidden.new_empty(n, CODEBOOK_SIZE)
            for k in sorted(set(phases)):
                rows = torch.tensor([i for i, q in enumerate(phases) if q == k], device=self.device)
                codes[rows] = F.linear(hidden[rows], self._head_at(k))
        if masked:
            eos = eos + self.eos_bias[phase, None]
        return torch.cat([codes, eos], dim=-1).float()

    def _head_at(self, k: int) -> torch.Tensor:
        """lm_head rows of the codes at frame position k."""
        return self.head_codes[k * CODEBOOK_SIZE : (k + 1) * CODEBOOK_SIZE]

    # -- stepping hooks --
    @torch.inference_mode()
    def _admit(self, req: GenerationRequest) -> _Row:
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
        slot = heapq.heappop(self.free_slots)
        s = req.sampling
        seed = secrets.randbits(63) if s.seed is None else s.seed
        try:
            if len(ids) > 1:
                self.forward(torch.tensor([ids[:-1]], device=self.device), [slot], [0])
            self._reset_slot(slot, ids, s.temperature, s.top_p, s.repetition_penalty, seed)
        except BaseException:
            heapq.heappush(self.free_slots, slot)
            raise
        gen = None
        if self.sampler == "reference" and s.seed is not None:
            gen = torch.Generator(self.device).manual_seed(s.seed)
        return _Row(req, slot, len(ids) - 1, ids[-1], 0, frozenset(req.stop_ids), seed, gen)

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

    @torch.inference_mode()
    def _step(self, states: list[_Row]) -> list[tuple[list[int], str | None]]:
        """One batched decode forward over every live row, then sampling; new ids and finish reasons."""
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        rows = [states[i] for i in order]
        if self.sampler == "reference":
            new = self._decode_reference(rows)
        elif self.static_shapes and all(r.req.constrain_audio for r in rows):
            new = self._decode_static(rows)
        else:
            new = self._decode(rows)
        out: list[tuple[list[int], str | None]] = [([], None)] * len(rows)
        for i, (row, tok) in enumerate(zip(rows, new, strict=True)):
            row.pos += 1
            row.generated += 1
            row.last = tok
            if tok in row.stop_ids:
                out[order[i]] = ([], FinishReason.STOP)
            elif row.generated >= row.req.max_new_tokens or row.pos + 1 >= self.max_seq_len:
                out[order[i]] = ([tok], FinishReason.LENGTH)
            else:
                out[order[i]] = ([tok], None)
        return out

    def _decode(self, rows: list[_Row]) -> list[int]:
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

    def _phases(self, rows: list[_Row]) -> list[int] | None:
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

    def _decode_static(self, rows: list[_Row]) -> list[int]:
        """Forward and sample the cache window [0, bucket), rows without a request padded inactive; chosen ids."""
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

    def _static_meta(self, rows: list[_Row]) -> tuple[int, torch.Tensor]:
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

    # -- the reference sampler (today's, for side-by-side benchmarks) --
    def _decode_reference(self, rows: list[_Row]) -> list[int]:
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

    def _sample_reference(self, hidden: torch.Tensor, rows: list[_Row], audio_only: bool) -> torch.Tensor:
        """Next id per row: repetition penalty, phase mask (audio_only), temperature (0: greedy), top-p."""
        dev = self.device
        logits = self.logits(hidden, audio_only)
        seen = self.seen[torch.tensor([r.slot for r in rows], device=dev)]
        if audio_only:
            seen = seen[:, self.audio_ids]
        penalty = torch.tensor([r.req.sampling.repetition_penalty for r in rows], device=dev)
        logits = reference_penalize(logits, seen, penalty)
        if audio_only:
            phase = torch.tensor([r.generated % TOKENS_PER_FRAME for r in rows], device=dev)
            logits = logits.masked_fill(self.audio_phase[None, :] != phase[:, None], float("-inf"))
        s = [r.req.sampling for r in rows]
        chosen = reference_sample(
            logits, [x.temperature for x in s], [x.top_p for x in s], [r.generator for r in rows], self.shared_generator
        )
        return self.audio_ids[chosen] if audio_only else chosen

    def _release(self, state: _Row) -> None:
        """Give the request's KV slot back (its sampling state is reset when the slot is next taken)."""
        heapq.heappush(self.free_slots, state.slot)

    async def close(self) -> None:
        """Stop the stepping thread and drop the model, KV cache and graphs."""
        await super().close()
        self.model = None
        self.k_cache = self.v_cache = []
        self._graphs = {}


def _buckets(top: int, start: int = 1) -> tuple[int, ...]:
    """Buckets: start, doubling while below top, then top."""
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)
