"""The portable default backend: a transformers Llama with our own continuous batching (gpt-fast style).

One static KV cache slot per live request; a new request is prefilled alone into its slot, then every
engine step runs one batched decode forward over all live rows (each at its own position) and samples
one id per row. The forward reuses the HF modules' weights, HF's rotary embedding (so llama3 RoPE
scaling is HF's) and SDPA with a per-row mask.

A row that is constrained to audio (the engine's default) computes only the logits its frame position can
take: the position's 4,096 codes and end of speech (`spec.allowed_ids`), a slice of lm_head. Its repetition
penalty reads a per-slot table over those columns, and `sampling.sample` draws the top-p nucleus without
sorting; one host sync per step (the chosen ids). The sampler this replaced (all 28,673 audio logits, full
sort) is `tools/bench/reference_sampler.py`'s subclass, for side-by-side benchmarks.

Static shapes (`static_shapes=True`, implied by `cuda_graphs=True`): the decode step runs over the cache
window [0, bucket) with the bucket a power of two, padding rows inactive, attention over the whole cache
length and no data-dependent branch, so that on CUDA each bucket is captured once as a CUDA graph and
replayed (on CUDA by default: the eager step is launch-bound there). Padding never changes a row's tokens, nor a
paused row's state (tested on CPU); captured on an H200, 4.8-6.2 ms a step at 1-64 rows (docs/benchmarks.md).

Batch-invariant steps (`batch_invariant=True`, implies static shapes): every decode step runs at the largest
bucket, `max_batch_size` rows attending over `max_seq_len` keys, so a row's arithmetic has the same shapes
whatever else is in the step, and a seeded request gives the tokens it has alone (prefills already run one
request at a time). The bucketed steps round differently with the bucket and can flip a nearly tied token. It
costs every step the largest bucket's work (docs/engine.md, "Seeds"); rows not constrained to audio still step
eagerly, outside the guarantee.

Prefix reuse (`prefix_reuse=True`): a request's shared leading ids (`GenerationRequest.prefix_len`, a cloned
voice's reference turn) are prefilled once; their keys and values are kept (an LRU of `max_prefixes`, keyed by
the adapter and the ids) and copied into each later row's slot at admission, which then prefills only the rest.

LoRA adapters (`adapters`, name -> PEFT folder): loaded at start and hooked into the targeted Linears
(`hf_lora.py`); each slot holds its request's adapter index (0: the base model) in a device table that every
forward reads, so one forward serves base and adapter rows together, in the eager, static and captured steps
alike. With no adapter configured nothing is hooked and the forward is the base model's.
"""

from __future__ import annotations

import collections
import heapq
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME, ModelSpec
from .hf_lora import LoraSet, load_adapters
from .protocol import FinishReason, GenerationRequest
from .sampling import penalize, sample, uniforms
from .stepped import SteppedBackend

COLUMNS = CODEBOOK_SIZE + 1  # a frame position's sub-vocab: its 4,096 codes, then end of speech
_UNLOADED = torch.empty(0)  # what a model-sized tensor holds until _load


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
        top_k: int = 64,
        cuda_graphs: bool = False,
        static_shapes: bool | None = None,
        batch_invariant: bool = False,
        prefix_reuse: bool = True,
        max_prefixes: int = 16,
        adapters: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    ):
        super().__init__(max_batch_size)
        if max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        if max_prefixes < 1:
            raise ValueError("max_prefixes must be >= 1")
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        on = torch.device(device)
        if cuda_graphs and on.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, got {device!r}")
        if batch_invariant and static_shapes is False:
            raise ValueError("batch_invariant steps need static shapes: leave static_shapes unset or True")
        # Options: set here, read-only afterwards (any thread).
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self._preloaded = None if isinstance(model, str) else model
        self.device = on
        self.static_shapes = batch_invariant or (cuda_graphs if static_shapes is None else static_shapes)
        self.batch_invariant = batch_invariant
        self.cuda_graphs = cuda_graphs
        self.dtype = dtype or (torch.bfloat16 if on.type == "cuda" else torch.float32)
        self.max_seq_len = max_seq_len
        self.spec = spec
        self.top_k = top_k
        self.prefix_reuse = prefix_reuse
        self.max_prefixes = max_prefixes
        self.adapters = tuple(sorted(dict(adapters).items()))  # (name, PEFT folder or hub id), loaded by _load
        # Shared prefixes' keys and values per layer, (kv head, position, head_dim) each, by (adapter, prefix ids)
        # (an adapter's keys and values differ from the base model's), most recently used last.
        self._prefixes: collections.OrderedDict[_PrefixKey, tuple[list[torch.Tensor], list[torch.Tensor]]]
        self._prefixes = collections.OrderedDict()
        self._prefix_lock = threading.Lock()  # guards _prefixes (forget_prefix comes from any thread)
        # CPU splits rows by sampling path (reading flags is free there); CUDA never branches on device data.
        self.branch_free = self.static_shapes or on.type == "cuda"
        self.buckets = _buckets(max_batch_size)  # cache rows a static step covers
        self.length_buckets = _buckets(max_seq_len, start=min(64, max_seq_len))  # keys a static step attends over
        if batch_invariant:  # one shape for every step: the largest
            self.buckets, self.length_buckets = self.buckets[-1:], self.length_buckets[-1:]
        # How a step decodes its rows, chosen once: the static step where shapes are static, else the eager one.
        self._decode_rows: Callable[[list[Row]], list[int]] = (
            self._decode_static if self.static_shapes else self._decode
        )
        # Filled by _load and owned by the stepping thread from then on (close() drops it once that has ended).
        self.model: torch.nn.Module | None = None
        self.head_dim = 0
        self.vocab_size = 0
        self.k_cache: list[torch.Tensor] = []  # per layer: (slot, kv head, position, head_dim)
        self.v_cache: list[torch.Tensor] = []
        self.free_slots = list(range(max_batch_size))  # a heap: the lowest free slot is taken first
        self.col_ids = _UNLOADED  # (7, 4097): id of each column at each frame position
        self.col_bias = _UNLOADED  # (7, 4097): 0 where the position allows the column, else -inf
        self.eos_bias = _UNLOADED  # (7,): the end-of-speech column's bias, the only column that is ever -inf
        self.head_codes = _UNLOADED  # lm_head rows of every code: row k*4096 + c is code c at position k (a view)
        self.head_eos = _UNLOADED  # lm_head row of end of speech (a view)
        self.seen = _UNLOADED  # (slot, vocab) bool: ids seen, for the penalty of unconstrained rows
        self.audio_seen = _UNLOADED  # (slot, 7, 4097): 1.0 where the column was seen (floats: the penalty multiplies)
        self.slot_sampling = _UNLOADED  # (slot, 3): temperature, top_p, repetition penalty
        self.slot_seed = _UNLOADED  # (slot,): the seed of each slot's counter-based uniforms
        self.slot_adapter = _UNLOADED  # (slot,): the adapter index of each slot's request (0: the base model)
        self.lora: LoraSet | None = None  # the adapters hooked into the model, if any
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    # -- model (everything below runs on the stepping thread) --
    @torch.inference_mode()
    def _load(self) -> None:
        """Load the model, allocate the KV cache, the per-position head tables and the per-slot sampling state."""
        if self._preloaded is not None:
            model = self._preloaded.to(dtype=self.dtype)
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_name, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        if self.adapters:
            self.lora = load_adapters(self.model, self.adapters, self.device, self.dtype)
        cfg = self.model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (self.max_batch_size, cfg.num_key_value_heads, self.max_seq_len, self.head_dim)
        kw = {"dtype": self.dtype, "device": self.device}
        self.k_cache = [torch.zeros(shape, **kw) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, **kw) for _ in range(cfg.num_hidden_layers)]
        self.vocab_size = self.model.lm_head.weight.shape[0]
        self._build_head_tables()
        dev, n = self.device, self.max_batch_size
        self.seen = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=dev)
        self.audio_seen = torch.zeros(n, TOKENS_PER_FRAME, COLUMNS, device=dev)
        self.slot_sampling = torch.tensor([[0.0, 1.0, 1.0]] * n, device=dev)
        self.slot_seed = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_adapter = torch.zeros(n, dtype=torch.long, device=dev)
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
        self.col_ids = torch.from_numpy(ids).to(self.device)
        bias = torch.zeros(allowed.shape).masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        self.col_bias = bias.to(self.device)
        self.eos_bias = self.col_bias[:, CODEBOOK_SIZE].contiguous()
        w, lo = self.model.lm_head.weight, spec.first_audio_token
        self.head_codes = w[lo : lo + TOKENS_PER_FRAME * CODEBOOK_SIZE]
        self.head_eos = w[eos : eos + 1]

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

        if self.lora is not None:  # each row's adapter, read on the device: no branch on which rows use one
            self.lora.select(self.slot_adapter[slots])
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
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden (..., D) over the whole vocab."""
        return self.model.lm_head(hidden).float()

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

    def _adapter_index(self, name: str | None) -> int:
        """The adapter index of a request's adapter (0: none); ValueError for one this backend has not loaded."""
        if self.lora is not None:
            return self.lora.index(name)
        if name is not None:
            raise ValueError(f"unknown adapter {name!r}; this backend has no adapters (EngineConfig.adapters)")
        return 0

    def _prefill(self, slot: int, ids: tuple[int, ...], shared: int, adapter: str | None = None) -> None:
        """Put the keys and values of `ids` in `slot` (whose adapter is `adapter`), its first `shared` ids from the
        prefix store (computed and stored if absent), the rest by a forward."""
        start = 0
        if 0 < shared <= len(ids):
            key = (adapter, ids[:shared])
            with self._prefix_lock:
                kv = self._prefixes.get(key)
                if kv is not None:
                    self._prefixes.move_to_end(key)
            if kv is None:
                self._counters["prefix_misses"] += 1
                self.forward(torch.tensor([ids[:shared]], device=self.device), [slot], [0])
                kv = (
                    [k[slot, :, :shared].clone() for k in self.k_cache],
                    [v[slot, :, :shared].clone() for v in self.v_cache],
                )
                with self._prefix_lock:
                    self._prefixes[key] = kv
                    while len(self._prefixes) > self.max_prefixes:
                        self._prefixes.popitem(last=False)
            else:
                self._counters["prefix_hits"] += 1
                for cache, stored in zip((*self.k_cache, *self.v_cache), (*kv[0], *kv[1]), strict=True):
                    cache[slot, :, :shared] = stored
            start = shared
        if len(ids) > start:
            self.forward(torch.tensor([ids[start:]], device=self.device), [slot], [start])

    def forget_prefix(self, ids: tuple[int, ...]) -> None:
        """Free the stored keys and values of prefix `ids` (of every adapter), if stored (any thread; a voice was
        removed)."""
        ids = tuple(ids)
        with self._prefix_lock:
            for key in [k for k in self._prefixes if k[1] == ids]:
                del self._prefixes[key]

    def stats(self) -> dict:
        with self._prefix_lock:
            cached = len(self._prefixes)
        adapters = {"adapters": list(self.lora.names)} if self.lora is not None else {}
        return {**super().stats(), "cached_prefixes": cached, "batch_invariant": self.batch_invariant, **adapters}

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
    def _step(self, states: list[Row]) -> list[tuple[list[int], str | None]]:
        """One batched decode forward over every live row, then sampling; new ids and finish reasons."""
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        rows = [states[i] for i in order]
        new = self._decode_rows(rows)
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

    def _release(self, state: Row) -> None:
        """Give the request's KV slot back (its sampling state is reset when the slot is next taken)."""
        heapq.heappush(self.free_slots, state.slot)

    async def close(self) -> None:
        """Stop the stepping thread and drop the model, KV cache and graphs."""
        await super().close()
        if self.lora is not None:
            self.lora.remove()  # a model passed in computes the base alone again
            self.lora = None
        self.model = None
        self.k_cache = self.v_cache = []
        self._graphs = {}
        with self._prefix_lock:
            self._prefixes.clear()


_PrefixKey = tuple[str | None, tuple[int, ...]]  # a stored prefix: (its adapter, its ids)


def _buckets(top: int, start: int = 1) -> tuple[int, ...]:
    """Buckets: start, doubling while below top, then top."""
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)
