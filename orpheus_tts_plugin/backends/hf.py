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

The backend is four layers, one job each, under this front (options, load, stats, close): `hf_model.py` (the
model, its KV cache, forward and per-position head) <- `hf_prefill.py` (prefill, the prefix store) <- `hf_rows.py`
(slots: admission, per-slot sampling state, release) <- `hf_step.py` (the decode step, static shapes, CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..spec import ENGLISH, ModelSpec
from .hf_model import COLUMNS
from .hf_prefill import PrefixStore
from .hf_rows import Row
from .hf_step import HFStep, step_buckets

__all__ = ["COLUMNS", "HFBackend", "Row"]


class HFBackend(HFStep):
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
        # CPU splits rows by sampling path (reading flags is free there); CUDA never branches on device data.
        self.branch_free = self.static_shapes or on.type == "cuda"
        # Cache rows and keys a static step covers (batch and length buckets).
        self.buckets, self.length_buckets = step_buckets(max_batch_size, max_seq_len, batch_invariant)
        self._prefixes = PrefixStore(max_prefixes)  # shared prefixes' keys and values (any thread: it locks)
        self._init_model()
        self._init_rows()
        self._init_step()

    @torch.inference_mode()
    def _load(self) -> None:
        """Load the model, allocate the KV cache, the per-position head tables and the per-slot sampling state."""
        self._load_model()
        self._allocate_rows()
        if self.cuda_graphs:
            self._capture_graphs()

    def stats(self) -> dict:
        cached = len(self._prefixes)
        adapters = {"adapters": list(self.lora.names)} if self.lora is not None else {}
        return {**super().stats(), "cached_prefixes": cached, "batch_invariant": self.batch_invariant, **adapters}

    async def close(self) -> None:
        """Stop the stepping thread and drop the model, KV cache and graphs."""
        await super().close()
        self._unload_model()
        self._graphs = {}
        self._prefixes.clear()
