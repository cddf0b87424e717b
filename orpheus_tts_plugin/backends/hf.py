"""The portable default backend: a transformers Llama with our own continuous batching (gpt-fast style).

One static KV cache slot per live request; a new request is prefilled alone into its slot, then every
engine step runs one batched decode forward over all live rows (each at its own position) and samples
one id per row. The forward reuses the HF modules' weights, HF's rotary embedding (so llama3 RoPE
scaling is HF's) and SDPA with a per-row mask.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME, ModelSpec
from .base import FinishReason, GenerationRequest, SteppedBackend


@dataclass
class _Row:
    """State of one live request: its KV cache slot and where it stands."""

    req: GenerationRequest
    slot: int
    pos: int  # ids already in the KV cache
    last: int  # id fed at the next step (not yet in the cache)
    generated: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None


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
    ):
        super().__init__(max_batch_size)
        if max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self._preloaded = None if isinstance(model, str) else model
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_seq_len = max_seq_len
        self.spec = spec
        self.model = None

    # -- model --
    @torch.inference_mode()
    def _load(self) -> None:
        """Load the model (or take the preloaded one), allocate the KV cache and the audio-only lm_head tables."""
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
        self.seen = torch.zeros(self.max_batch_size, self.vocab_size, dtype=torch.bool, device=self.device)
        self.free_slots = list(range(self.max_batch_size))
        # Audio-only head: sub-vocab index j < 7*4096 is id first_audio_token + j; the last is end of speech.
        spec, n_audio = self.spec, TOKENS_PER_FRAME * CODEBOOK_SIZE
        self.audio_lo = spec.first_audio_token
        self.audio_ids = torch.tensor(spec.audio_ids, device=self.device)
        self.audio_phase = torch.cat(  # frame position at which each sub-vocab id is allowed
            [torch.arange(n_audio) // CODEBOOK_SIZE, torch.tensor([0])]
        ).to(self.device)
        self.shared_generator = torch.Generator(self.device)
        self.shared_generator.seed()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, slots: list[int], starts: list[int]) -> torch.Tensor:
        """Run ids (n, T) at positions starts[i].. in KV slots[i] (ascending); the final hidden (n, T, D)."""
        model = self.model.model
        n, T = ids.shape
        dev = self.device
        lo, hi = slots[0], slots[-1] + 1
        slots_t = torch.tensor(slots, device=dev)
        rows = slots_t - lo  # rows of the cache window [lo, hi)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(T, device=dev)  # (n, T)
        L = max(starts) + T
        # Attention runs over the whole cache window; rows of it with no request here see key 0 only.
        window = hi - lo
        dense = window == n
        mask = torch.zeros(window, 1, T, L, dtype=torch.bool, device=dev)
        mask[..., 0] = True
        mask[rows] = (torch.arange(L, device=dev) <= pos[:, :, None])[:, None]

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
            kc[slots_t[:, None], :, pos] = k.transpose(1, 2)
            vc[slots_t[:, None], :, pos] = v.transpose(1, 2)
            if not dense:
                q = q.new_zeros(window, *q.shape[1:]).index_copy_(0, rows, q)
            o = F.scaled_dot_product_attention(q, kc[lo:hi, :, :L], vc[lo:hi, :, :L], attn_mask=mask, enable_gqa=True)
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

    # -- stepping hooks --
    @torch.inference_mode()
    def _admit(self, req: GenerationRequest) -> _Row:
        """Check the request, take a KV slot and prefill all but the last prompt id into it."""
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
        try:
            if len(ids) > 1:
                self.forward(torch.tensor([ids[:-1]], device=self.device), [slot], [0])
            self.seen[slot] = False
            self.seen[slot, torch.tensor(ids, device=self.device)] = True
        except BaseException:
            heapq.heappush(self.free_slots, slot)
            raise
        seed = req.sampling.seed
        gen = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        return _Row(req, slot, len(ids) - 1, ids[-1], 0, frozenset(req.stop_ids), gen)

    @torch.inference_mode()
    def _step(self, states: list[_Row]) -> list[tuple[list[int], str | None]]:
        """One batched decode forward over every live row, then sampling; new ids and finish reasons."""
        order = sorted(range(len(states)), key=lambda i: states[i].slot)
        rows = [states[i] for i in order]
        slots = [r.slot for r in rows]
        ids = torch.tensor([[r.last] for r in rows], device=self.device)
        hidden = self.forward(ids, slots, [r.pos for r in rows])[:, -1]
        new = torch.empty(len(rows), dtype=torch.long, device=self.device)
        for audio_only in (True, False):
            group = [i for i, r in enumerate(rows) if r.req.constrain_audio == audio_only]
            if group:
                idx = torch.tensor(group, device=self.device)
                new[idx] = self._sample(hidden[idx], [rows[i] for i in group], audio_only)
        self.seen[torch.tensor(slots, device=self.device), new] = True

        out: list[tuple[list[int], str | None]] = [([], None)] * len(rows)
        for i, (row, tok) in enumerate(zip(rows, new.tolist(), strict=True)):
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

    def _sample(self, hidden: torch.Tensor, rows: list[_Row], audio_only: bool) -> torch.Tensor:
        """Next id per row: repetition penalty, phase mask (audio_only), temperature (0: greedy), top-p."""
        dev = self.device
        logits = self.logits(hidden, audio_only)
        seen = self.seen[torch.tensor([r.slot for r in rows], device=dev)]
        if audio_only:
            seen = seen[:, self.audio_ids]
        penalty = torch.tensor([r.req.sampling.repetition_penalty for r in rows], device=dev)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if audio_only:
            phase = torch.tensor([r.generated % TOKENS_PER_FRAME for r in rows], device=dev)
            logits = logits.masked_fill(self.audio_phase[None, :] != phase[:, None], float("-inf"))
        chosen = logits.argmax(-1)
        temps = [r.req.sampling.temperature for r in rows]
        if any(t > 0 for t in temps):
            temp = torch.tensor(temps, device=dev)
            probs = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)
            top_p = [r.req.sampling.top_p for r in rows]
            if any(p < 1.0 for p in top_p):
                sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
                drop = sorted_p.cumsum(-1) - sorted_p > torch.tensor(top_p, device=dev)[:, None]
                probs = torch.zeros_like(probs).scatter_(-1, sorted_i, sorted_p.masked_fill(drop, 0.0))
            # Exponential race (argmax of p / Exp(1)) samples from p; one generator per seeded row.
            race = torch.empty_like(probs)
            shared = [i for i, r in enumerate(rows) if r.generator is None]
            for i, r in enumerate(rows):
                if r.generator is not None:
                    race[i].exponential_(generator=r.generator)
            if shared:
                noise = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                    generator=self.shared_generator
                )
                race[torch.tensor(shared, device=dev)] = noise
            chosen = torch.where(temp > 0, (probs / race).argmax(-1), chosen)
        return self.audio_ids[chosen] if audio_only else chosen

    def _release(self, state: _Row) -> None:
        """Give the request's KV slot back."""
        heapq.heappush(self.free_slots, state.slot)

    async def close(self) -> None:
        """Stop the stepping thread and drop the model and KV cache."""
        await super().close()
        self.model = None
        self.k_cache = self.v_cache = []
