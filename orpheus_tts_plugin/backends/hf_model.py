"""The hf backend's model: loading it (dtype, device, LoRA adapters), its static KV cache, the forward over cache
slots and the logits of each frame position (lm_head sliced by `spec.allowed_ids`).

The bottom layer of HFBackend (hf.py), whose `__init__` sets the options read here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..spec import CODEBOOK_SIZE, TOKENS_PER_FRAME
from .hf_lora import LoraSet, load_adapters
from .stepped import SteppedBackend

COLUMNS = CODEBOOK_SIZE + 1  # a frame position's sub-vocab: its 4,096 codes, then end of speech
UNLOADED = torch.empty(0)  # what a model-sized tensor holds until _load


class HFModel(SteppedBackend):
    """The Llama the backend runs, its KV cache and its per-frame-position head."""

    def _init_model(self) -> None:
        # Filled by _load_model and owned by the stepping thread from then on (close() drops it once that has ended).
        self.model: torch.nn.Module | None = None
        self.head_dim = 0
        self.vocab_size = 0
        self.k_cache: list[torch.Tensor] = []  # per layer: (slot, kv head, position, head_dim)
        self.v_cache: list[torch.Tensor] = []
        self.col_ids = UNLOADED  # (7, 4097): id of each column at each frame position
        self.col_bias = UNLOADED  # (7, 4097): 0 where the position allows the column, else -inf
        self.eos_bias = UNLOADED  # (7,): the end-of-speech column's bias, the only column that is ever -inf
        self.head_codes = UNLOADED  # lm_head rows of every code: row k*4096 + c is code c at position k (a view)
        self.head_eos = UNLOADED  # lm_head row of end of speech (a view)
        self.slot_adapter = UNLOADED  # (slot,): the adapter index of each slot's request (0: the base model)
        self.lora: LoraSet | None = None  # the adapters hooked into the model, if any

    def _load_model(self) -> None:
        """Load the model and its adapters, allocate the KV cache, build the per-position head tables."""
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
        self.slot_adapter = torch.zeros(self.max_batch_size, dtype=torch.long, device=self.device)

    def _unload_model(self) -> None:
        """Unhook the adapters, drop the model and the KV cache (the stepping thread has ended)."""
        if self.lora is not None:
            self.lora.remove()  # a model passed in computes the base alone again
            self.lora = None
        self.model = None
        self.k_cache = self.v_cache = []

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

    def _adapter_index(self, name: str | None) -> int:
        """The adapter index of a request's adapter (0: none); ValueError for one this backend has not loaded."""
        if self.lora is not None:
            return self.lora.index(name)
        if name is not None:
            raise ValueError(f"unknown adapter {name!r}; this backend has no adapters (EngineConfig.adapters)")
        return 0

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
        dev, head_dim, k_cache, v_cache = self.device, self.head_dim, self.k_cache, self.v_cache
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
            q = attn.q_proj(h).view(n, T, -1, head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(n, T, -1, head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(n, T, -1, head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            kc, vc = k_cache[i], v_cache[i]
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
