"""Next-token sampling that does the least work.

It draws from the same distribution as the reference sampler it replaced (tools/bench/reference_sampler.py):
HF-style repetition penalty, softmax(logits / temperature), then the top-p nucleus as HF defines it: sorted by
probability, an id is kept while the mass before it is <= top_p. Temperature 0 is greedy (argmax of the
penalised logits, first index on ties).

The reference sorts every row. `sample` does not sort:
- top-k: the k most probable ids hold more than top_p of the mass, so the nucleus lies inside them;
- otherwise an exact radix select on the float32 bits of the probabilities (three histogram passes of
  11/11/9 bits, the last group being exactly tied values, ordered by index as a stable sort orders them);
- the draw is an inverse-CDF lookup with one uniform per row from `uniforms`, a counter-based hash of
  (seed, token index): a row's draws depend on its seed only, never on the other rows of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF
_RADIX = ((20, 11), (9, 11), (0, 9))  # (shift, width): the 31 value bits of a non-negative float32


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's repetition penalty on finite logits: seen ids' positive logits divided by the penalty, negative multiplied.

    `seen` is bool or 0/1 floats. Exactly HF's values (x / p + 0 * p == x / p), in arithmetic rather than
    `where`, which is several times slower on CPU.
    """
    p = penalty[:, None]
    s = seen.to(logits.dtype)
    penalised = logits.clamp_min(0) / p + logits.clamp_max(0) * p
    return penalised * s + logits * (1 - s)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (C. Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in [0, 1 - 2**-24] per row from (seed in [0, 2**63), counter >= 0): stateless, batchable."""
    h = _mix32((counters & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ (seeds & _M32))
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    return (h >> 8).to(torch.float32) * 2.0**-24


def draw(weights: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """Index per row drawn with probability weights / row sum (inverse CDF at u); never an index of weight 0.

    u * total < total, so the index found has weight > 0 unless rounding in a parallel scan says otherwise:
    then `fallback` (an index of positive weight), or without one (CPU) the row's argmax, fixed on the host.
    """
    cum = weights.cumsum(-1)
    at = (u * cum[:, -1])[:, None].contiguous()
    i = torch.searchsorted(cum, at, right=True).clamp_max(weights.shape[-1] - 1)
    ok = weights.gather(-1, i) > 0
    if fallback is not None:
        return torch.where(ok, i, fallback[:, None])[:, 0]
    i = i[:, 0]
    if not bool(ok.all()):
        bad = ~ok[:, 0]
        i[bad] = weights[bad].argmax(-1)
    return i


def topk_nucleus(probs: torch.Tensor, top_p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidate ids (m, k), their nucleus weights (m, k), whether the nucleus fits in them (m,))."""
    vals, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)
    cum = vals.cumsum(-1)
    weights = vals.masked_fill(cum - vals > top_p[:, None], 0.0)
    fits = (cum[:, -1] > top_p) | (idx.shape[-1] == probs.shape[-1])  # the (k+1)-th id has mass before it > top_p
    return idx, weights, fits


def radix_nucleus(probs: torch.Tensor, top_p: torch.Tensor, branch_free: bool = True) -> torch.Tensor:
    """The exact top-p nucleus (m, V) as a 0/1 mask of probs' dtype, without sorting: radix select on float32 bits.

    Each pass splits the group that holds the boundary id (the last id kept) by the next bits of the key and
    finds, from the group's mass per digit, the digit whose ids cross top_p; the ids above it are kept. When a
    whole group fits (top_p >= its mass and all above) the lowest digit is taken and everything above it kept,
    which keeps the whole group in the end. Ids tied with the boundary value are kept in index order while the
    mass before them fits; not branch_free, that ranking is skipped when no row has such a tie.
    """
    m = probs.shape[0]
    key = probs.view(torch.int32)  # float32 probs >= 0: their int32 bits order like their values
    tp = top_p[:, None]
    prefix = key.new_zeros(m, 1)  # high bits of the group that holds the boundary id
    above = probs.new_zeros(m, 1)  # mass of the ids above that group: all kept
    for shift, width in _RADIX:
        high, n = key >> shift, 1 << width
        digit = high & (n - 1)
        if shift + width < 31:  # ids below / in / above the group go to bins [0, n) / [n, 2n) / [2n, 3n)
            digit = digit + n * (((high >> width) - prefix).clamp(-1, 1) + 1)
        mass = probs.new_zeros(m, 3 * n).scatter_add_(1, digit.long(), probs)
        mass = mass[:, :n] if shift + width == 31 else mass[:, n : 2 * n]
        at_or_above = F.pad(mass.flip(1).cumsum(1).flip(1), (0, 1))  # [d]: group mass at digits >= d; [n] = 0
        d = (((above + at_or_above) > tp).sum(1, keepdim=True) - 1).clamp_min(0)  # the boundary id's digit
        above = above + at_or_above.gather(1, d + 1)
        prefix = (prefix << width) | d.int()
    tied = key == prefix  # prefix: the boundary value's whole key
    if not branch_free and int(tied.sum(-1).max()) <= 1:
        return ((key - prefix).clamp(-1, 0) + 1).to(probs.dtype)  # key >= prefix, without bool tensors (slow on CPU)
    rank = tied.cumsum(-1, dtype=torch.int32) - 1
    return ((key > prefix) | (tied & (above + rank * prefix.view(torch.float32) <= tp))).to(probs.dtype)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    top_k: int = 64,
    branch_free: bool = False,
) -> torch.Tensor:
    """Column per row of penalised float32 logits (m, V): greedy where temperature is 0, else from the nucleus.

    branch_free (CUDA, graph capture): no data-dependent branch and no host read; every sampled row takes the
    exact radix path. Otherwise (CPU, where reading a flag costs no device sync) rows go by what they need:
    the top-k path where it can hold the nucleus (k * max prob > top_p), the radix path for the rest, none
    where top_p is 1, nothing at all for greedy rows.
    """
    if branch_free:
        greedy = logits.argmax(-1)
        probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
        weights = probs * torch.maximum(radix_nucleus(probs, top_p), (top_p >= 1.0).to(probs.dtype)[:, None])
        return torch.where(temperature > 0, draw(weights, u, greedy), greedy)
    hot = (temperature > 0).nonzero()[:, 0]
    if hot.numel() == logits.shape[0]:
        return _sample_hot(logits, temperature, top_p, u, top_k)
    out = logits.argmax(-1)
    if hot.numel():
        out[hot] = _sample_hot(logits[hot], temperature[hot], top_p[hot], u[hot], top_k)
    return out


def _sample_hot(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, top_k: int
) -> torch.Tensor:
    """`sample` for rows that all have temperature > 0, splitting them by nucleus path on the host (CPU)."""
    probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
    try_k = (top_p < 1.0) & (probs.amax(-1) * top_k > top_p)
    if not bool(try_k.any()):
        return draw(_radix_weights(probs, top_p), u)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    rows = try_k.nonzero()[:, 0]
    idx, weights, fits = topk_nucleus(probs[rows], top_p[rows], top_k)
    done = rows[fits]
    out[done] = idx[fits].gather(1, draw(weights[fits], u[done])[:, None])[:, 0]
    if done.numel() < logits.shape[0]:
        rest = torch.ones_like(try_k)
        rest[done] = False
        r = rest.nonzero()[:, 0]
        out[r] = draw(_radix_weights(probs[r], top_p[r]), u[r])
    return out


def _radix_weights(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs zeroed outside the nucleus by the radix path, rows with top_p 1 left whole (CPU: host flags)."""
    narrow = top_p < 1.0
    if bool(narrow.all()):
        return probs * radix_nucleus(probs, top_p, branch_free=False)
    weights = probs.clone()
    if bool(narrow.any()):
        weights[narrow] *= radix_nucleus(probs[narrow], top_p[narrow], branch_free=False)
    return weights
