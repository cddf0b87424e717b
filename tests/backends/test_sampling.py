"""The sort-free sampler: exact nucleus sets, the same distribution as the reference sampler, greedy, uniforms."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from orpheus_tts_plugin.backends.sampling import (
    draw,
    penalize,
    radix_nucleus,
    sample,
    topk_nucleus,
    uniforms,
)
from orpheus_tts_plugin.tools.bench.reference_sampler import reference_sample

# Significance of each goodness-of-fit test. Draws are seeded, so a test passes or fails the same way every run.
# Power: a sampler off by total variation d raises chi-square's mean by >= 4 N d^2 (Cauchy-Schwarz), so at
# N = 20,000 an error of d = 0.05 adds >= 200, about 7 standard deviations of chi-square for the <= 400-id
# nuclei here, far past the 1e-4 cut (about 3.7 standard deviations).
ALPHA = 1e-4
DRAWS = 20_000


def exact_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus mask in float64 from the float32 probs: stable sort, keep while the mass before is <= top_p."""
    p = probs.double()
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) <= top_p
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def mass_before(probs: torch.Tensor) -> torch.Tensor:
    """Per id, the float64 mass of the ids before it in the stable descending order."""
    p = probs.double()
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    return torch.empty_like(p).scatter_(-1, order, sorted_p.cumsum(-1) - sorted_p)


def assert_same_nucleus(ours: torch.Tensor, probs: torch.Tensor, top_p: float) -> None:
    """ours is the exact nucleus, but for ids whose mass before is within fp32 rounding (1e-5) of top_p."""
    diff = ours ^ exact_nucleus(probs, top_p)
    assert ((mass_before(probs)[diff] - top_p).abs() < 1e-5).all()
    assert diff.sum() <= max(2, 0.01 * ours.sum())


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit of counts to expected counts (over ids with expected > 0): the chi-square p-value."""
    m = expected > 0
    stat = ((counts[m] - expected[m]) ** 2 / expected[m]).sum()
    df = torch.tensor((int(m.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two samples of equal size from the same law: chi-square p-value of sum (a - b)^2 / (a + b)."""
    m = (a + b) > 0
    stat = ((a[m] - b[m]) ** 2 / (a[m] + b[m])).sum()
    df = torch.tensor((int(m.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def nucleus_law(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution both samplers must draw from, in float64."""
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = exact_nucleus(probs[None], top_p)[0]
    q = probs.double() * keep
    return q / q.sum()


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.8, 0.95, 0.999])
def test_radix_nucleus_is_the_sorted_nucleus(scale: float, top_p: float) -> None:
    g = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    logits = torch.randn(64, 4097, generator=g) * scale
    logits[:8, 4096] = float("-inf")  # a forbidden column, as end of speech inside a frame
    probs = torch.softmax(logits, dim=-1)
    for branch_free in (False, True):
        ours = radix_nucleus(probs, torch.full((64,), top_p), branch_free)
        assert_same_nucleus(ours.bool(), probs, top_p)


def test_radix_nucleus_keeps_ties_in_index_order() -> None:
    """Many exactly equal probabilities (coarse logits): the boundary falls inside a tie, as a stable sort cuts it."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(200, 300, generator=g) * 4).round() / 4  # 20-odd distinct values per row
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.3, 0.8):
        for branch_free in (False, True):
            ours = radix_nucleus(probs, torch.full((200,), top_p), branch_free)
            assert_same_nucleus(ours.bool(), probs, top_p)


def test_topk_nucleus_when_it_fits() -> None:
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(256, 4097, generator=g) * 2.5, dim=-1)
    top_p = torch.full((256,), 0.8)
    idx, weights, fits = topk_nucleus(probs, top_p, k=64)
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, weights > 0)
    assert_same_nucleus(kept[fits], probs[fits], 0.8)
    torch.testing.assert_close(weights[fits].sum(-1), (probs * kept)[fits].sum(-1))
    assert (mass_before(probs)[~fits].gather(1, idx[~fits, -1:]) <= 0.8 + 1e-5).all()  # a wider nucleus: no fit
    assert 0 < int(fits.sum()) < 256  # both paths exercised


@pytest.mark.parametrize(
    "scale, temperature, top_p, top_k, path",
    [
        (1.5, 0.7, 0.8, 64, "top-k"),  # nucleus of a few dozen ids: inside the top 64
        (0.4, 0.6, 0.8, 64, "radix"),  # nucleus of hundreds: wider than k, the exact fallback
        (0.4, 1.0, 1.0, 64, "whole"),  # top_p 1: the whole distribution
        (2.0, 1.0, 0.4, 8, "top-k"),  # 3 ids, k = 8
    ],
)
@pytest.mark.parametrize("branch_free", [False, True])
def test_sample_draws_the_reference_distribution(
    scale: float, temperature: float, top_p: float, top_k: int, path: str, branch_free: bool
) -> None:
    g = torch.Generator().manual_seed(int(scale * 10) + top_k)
    row = torch.randn(512, generator=g) * scale
    row[-1] = float("-inf")
    law = nucleus_law(row, temperature, top_p)
    width = int((law > 0).sum())
    assert (width <= top_k) == (path == "top-k") and (width > 300) == (path == "whole")
    probs = torch.softmax(row / temperature, dim=-1)[None]
    fits = topk_nucleus(probs, torch.tensor([top_p]), top_k)[2]
    assert bool(fits & (probs.max() * top_k > top_p)) == (path == "top-k")  # the path `sample` takes on CPU
    ours = torch.zeros(512, dtype=torch.float64)
    reference = torch.zeros(512, dtype=torch.float64)
    shared = torch.Generator().manual_seed(11)
    for start in range(0, DRAWS, 5_000):  # 5,000 rows at a time: bounded memory
        n = min(5_000, DRAWS - start)
        logits = row.expand(n, -1).contiguous()
        temp, tp = torch.full((n,), temperature), torch.full((n,), top_p)
        u = uniforms(torch.arange(start, start + n), torch.zeros(n, dtype=torch.long))
        ours += torch.bincount(sample(logits, temp, tp, u, top_k, branch_free), minlength=512)
        ref = reference_sample(logits, [temperature] * n, [top_p] * n, [None] * n, shared)
        reference += torch.bincount(ref, minlength=512)
    assert ours[law == 0].sum() == 0 and reference[law == 0].sum() == 0  # never outside the nucleus
    assert chi2_pvalue(ours, DRAWS * law) > ALPHA
    assert chi2_pvalue(reference, DRAWS * law) > ALPHA
    assert homogeneity_pvalue(ours, reference) > ALPHA
    # Total variation from the law: sampling noise alone gives about sum sqrt(q (1 - q) / (2 pi N)).
    noise = float((law * (1 - law) / (2 * torch.pi * DRAWS)).sqrt().sum())
    assert 0.5 * float((ours / DRAWS - law).abs().sum()) < 1.5 * noise


@pytest.mark.parametrize("branch_free", [False, True])
def test_greedy_is_the_reference_argmax(branch_free: bool) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 4097, generator=g) * 4).round()  # ties: the first index wins in both
    zero = torch.zeros(64)
    ours = sample(logits, zero, torch.full((64,), 0.8), uniforms(torch.arange(64), zero.long()), 64, branch_free)
    ref = reference_sample(logits, [0.0] * 64, [0.8] * 64, [None] * 64, torch.Generator())
    assert torch.equal(ours, ref)


def test_mixed_rows_keep_their_own_parameters() -> None:
    """Greedy, top-k, radix and whole-distribution rows in one batch: each as when alone."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 4097, generator=g) * torch.tensor([2.0, 2.0, 0.3, 0.3, 2.0, 0.3, 1.0, 1.0])[:, None]
    temp = torch.tensor([0.0, 0.7, 0.7, 1.0, 0.0, 0.6, 0.5, 0.9])
    top_p = torch.tensor([0.8, 0.8, 0.8, 1.0, 1.0, 0.5, 0.9, 0.2])
    u = uniforms(torch.full((8,), 77), torch.arange(8))
    for branch_free in (False, True):
        batch = sample(logits, temp, top_p, u, 64, branch_free)
        alone = torch.cat(
            [sample(logits[i : i + 1], temp[i : i + 1], top_p[i : i + 1], u[i : i + 1]) for i in range(8)]
        )
        assert torch.equal(batch, alone)
        assert batch[0] == logits[0].argmax() and batch[4] == logits[4].argmax()


def test_draw_never_picks_a_zero_weight() -> None:
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.5 - 2**-24, 0.5, 1 - 2**-24])
    assert draw(weights, u, torch.zeros(4, dtype=torch.long)).tolist() == [1, 1, 3, 3]


def test_penalize_is_hf_repetition_penalty() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 50, generator=g)
    ids = torch.randint(0, 50, (3, 12), generator=g)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    for penalty in (1.1, 1.5, 0.8):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        torch.testing.assert_close(penalize(logits, seen, torch.full((3,), penalty)), expected)


def test_uniforms_are_uniform_reproducible_and_per_row() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1])
    counters = torch.arange(50_000)
    grid = uniforms(seeds[:, None].expand(-1, len(counters)).reshape(-1), counters.repeat(len(seeds)))
    assert grid.min() >= 0 and grid.max() <= 1 - 2**-24
    per_seed = grid.view(len(seeds), -1)
    for row in per_seed:  # 64 equal bins, 50,000 draws each seed
        counts = torch.histc(row, bins=64, min=0, max=1).double()
        assert chi2_pvalue(counts, torch.full((64,), len(counters) / 64, dtype=torch.float64)) > ALPHA
    assert abs(float(torch.corrcoef(per_seed[:2])[0, 1])) < 0.02  # neighbouring seeds: unrelated streams
    assert abs(float(torch.corrcoef(torch.stack([per_seed[0, :-1], per_seed[0, 1:]]))[0, 1])) < 0.02
    alone = uniforms(seeds[2:3], torch.tensor([777]))
    assert alone == per_seed[2, 777]  # a row's draw does not depend on the batch
