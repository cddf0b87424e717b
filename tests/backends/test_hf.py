"""HFBackend on the tiny test checkpoint: exact logits under continuous batching, per-position heads, the fast
sampler against the reference one, static-shape buckets, stops, aborts, reused slots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orpheus_tts_plugin.backends.hf import HFBackend
from orpheus_tts_plugin.backends.protocol import BackendError, FinishReason, GenerationRequest
from orpheus_tts_plugin.config import SamplingParams
from orpheus_tts_plugin.spec import CODEBOOK_SIZE, ENGLISH, TOKENS_PER_FRAME
from orpheus_tts_plugin.tools.bench.reference_sampler import ReferenceHFBackend
from orpheus_tts_plugin.tools.testmodel import make_test_model

SPEC = ENGLISH
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
GREEDY_PENALISED = SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def orpheus_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("testmodel")
    make_test_model(out, snac="tiny", seed=0)
    return str(out / "orpheus")


@pytest.fixture(scope="module")
def reference(orpheus_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(orpheus_dir).eval()


# The backend variants: the fast sampler (default), the reference sampler (the benchmarks' subclass), the
# static-shape step that CUDA graphs capture (run eagerly here: no GPU on the build machine).
VARIANTS: dict[str, tuple[type[HFBackend], dict[str, Any]]] = {
    "fast": (HFBackend, {}),
    "reference": (ReferenceHFBackend, {}),
    "static": (HFBackend, {"static_shapes": True}),
}


def variant_backend(orpheus_dir: str, variant: str, **kw: Any) -> HFBackend:
    """An unstarted backend of the variant (4 rows, 128 positions unless `kw` says otherwise)."""
    kind, options = VARIANTS[variant]
    return kind(orpheus_dir, **{"max_batch_size": 4, "max_seq_len": 128, **options, **kw})


@contextlib.asynccontextmanager
async def started(orpheus_dir: str, variant: str = "fast", **kw: Any) -> AsyncIterator[HFBackend]:
    backend = variant_backend(orpheus_dir, variant, **kw)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(params=list(VARIANTS))
async def any_backend(orpheus_dir: str, request: pytest.FixtureRequest):
    async with started(orpheus_dir, request.param) as backend:
        yield backend


@pytest.fixture
async def backend(orpheus_dir: str):
    async with started(orpheus_dir) as backend:
        yield backend


def prompt(n_text: int, seed: int) -> tuple[int, ...]:
    """An Orpheus-shaped prompt with n_text random text ids."""
    text = torch.randint(0, 128_000, (n_text,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (SPEC.start_of_human, SPEC.bos, *text, *SPEC.prompt_suffix())


def request(ids: tuple[int, ...], sampling: SamplingParams = GREEDY, max_new: int = 12, constrain: bool = False):
    return GenerationRequest(
        request_id=f"r{len(ids)}-{sampling.seed}",
        prompt_ids=ids,
        sampling=sampling,
        max_new_tokens=max_new,
        stop_ids=(SPEC.end_of_speech,),
        constrain_audio=constrain,
    )


async def collect(stream) -> tuple[list[int], str | None]:
    ids: list[int] = []
    async for chunk in stream:
        ids.extend(chunk)
    return ids, stream.finish_reason


@pytest.mark.parametrize("slots", [[0, 1, 2], [1, 4, 6]])
def test_forward_matches_hf_prefill_and_batched_decode(orpheus_dir: str, reference, slots: list[int]) -> None:
    backend = ReferenceHFBackend(orpheus_dir, max_batch_size=8, max_seq_len=64)  # also its audio-only logits
    backend._load()
    prompts = [torch.tensor(prompt(n, seed=n)) for n in (3, 14, 29)]
    gen = torch.Generator().manual_seed(7)
    full = [
        torch.cat([p, torch.randint(SPEC.first_audio_token, SPEC.vocab_size, (5,), generator=gen)]) for p in prompts
    ]
    with torch.no_grad():
        expected = [reference(f[None]).logits[0] for f in full]
    for p, slot, exp in zip(prompts, slots, expected, strict=True):  # prefill: one request at a time
        got = backend.logits(backend.forward(p[None], [slot], [0]))[0]
        torch.testing.assert_close(got, exp[: len(p)], atol=1e-4, rtol=1e-4)
    pos = [len(p) for p in prompts]
    for _ in range(5):  # batched decode: 3 rows at different positions
        ids = torch.stack([f[q] for f, q in zip(full, pos, strict=True)])[:, None]
        hidden = backend.forward(ids, slots, pos)[:, -1]
        got = backend.logits(hidden)
        torch.testing.assert_close(
            got, torch.stack([e[q] for e, q in zip(expected, pos, strict=True)]), atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(backend.logits(hidden, audio_only=True), got[:, backend.audio_ids])
        for phases in ([0, 3, 6], [2, 2, 2], [0, 0, 5]):  # one head product per position, or one for all
            phase = torch.tensor(phases)
            want = got.gather(1, backend.col_ids[phase]) + backend.col_bias[phase]
            torch.testing.assert_close(backend.phase_logits(hidden, phase, phases), want)
            torch.testing.assert_close(backend.phase_logits(hidden, phase), want)
        pos = [q + 1 for q in pos]


def test_position_columns_are_the_spec_allowed_ids(orpheus_dir: str) -> None:
    backend = HFBackend(orpheus_dir, max_batch_size=2, max_seq_len=16)
    backend._load()
    for k in range(TOKENS_PER_FRAME):
        allowed = backend.col_bias[k] == 0
        assert backend.col_ids[k][allowed].tolist() == SPEC.allowed_ids(k).tolist()
        assert allowed[:CODEBOOK_SIZE].all() and bool(allowed[CODEBOOK_SIZE]) == (k == 0)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
async def test_greedy_batched_equals_hf_generate(any_backend: HFBackend, reference, penalty: float) -> None:
    """Unconstrained rows (the whole vocab): token for token what transformers' greedy generate gives."""
    backend = any_backend
    prompts = [prompt(n, seed=100 + n) for n in (2, 9, 21)]
    sampling = SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=penalty)
    streams = [backend.generate(request(p, sampling, max_new=16)) for p in prompts]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for p, (ids, finish) in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=16,
                repetition_penalty=penalty,
            )[0, len(p) :].tolist()
        if SPEC.end_of_speech in out:
            out = out[: out.index(SPEC.end_of_speech)]
            assert finish == FinishReason.STOP
        else:
            assert finish == FinishReason.LENGTH
        assert ids == out
        if penalty > 1.0:
            assert len(set(ids)) > 1  # penalised: not one id repeated
    assert len({tuple(ids) for ids, _ in results}) == len(prompts)  # rows not mixed up


async def greedy_constrained(backend: HFBackend, prompts: list[tuple[int, ...]], max_new: int = 30) -> list[list[int]]:
    """Greedy, penalised, audio-constrained tokens of the prompts, all in one batch."""
    streams = [backend.generate(request(p, GREEDY_PENALISED, max_new=max_new, constrain=True)) for p in prompts]
    return [ids for ids, _ in await asyncio.gather(*(collect(s) for s in streams))]


def audio_prompt(n_text: int, seed: int) -> tuple[int, ...]:
    """A prompt that also holds audio ids (as a voice-cloning prompt does): they count as seen for the penalty."""
    codes = [SPEC.audio_token(k % TOKENS_PER_FRAME, (seed * 131 + 17 * k) % CODEBOOK_SIZE) for k in range(21)]
    return (*prompt(n_text, seed)[:-1], *codes, SPEC.start_of_speech)


async def test_constrained_greedy_is_the_reference_token_for_token(orpheus_dir: str) -> None:
    """Per-position head, per-slot penalty, static buckets: the same greedy tokens as the reference sampler."""
    prompts = [prompt(3, 1), audio_prompt(9, 2), prompt(17, 3)]
    results = {}
    for variant in VARIANTS:
        async with started(orpheus_dir, variant) as backend:
            results[variant] = await greedy_constrained(backend, prompts)
    assert results["fast"] == results["reference"] == results["static"]
    assert all(len(set(ids)) > 10 for ids in results["fast"])  # penalised: not a few ids repeated


async def test_bucket_padding_never_changes_a_rows_tokens(orpheus_dir: str) -> None:
    """A row alone (bucket 1), among others in a padded bucket (3 rows in 4), in a wider bucket, across the
    attention length buckets 64 and 128: the same tokens as the unpadded eager step."""
    prompts = [prompt(5, 7), prompt(11, 8), prompt(2, 9)]
    async with started(orpheus_dir, "fast", max_batch_size=8) as backend:
        eager = await greedy_constrained(backend, prompts, max_new=60)
    async with started(orpheus_dir, "static", max_batch_size=8) as backend:
        alone = [(await greedy_constrained(backend, [p], max_new=60))[0] for p in prompts]
        padded = await greedy_constrained(backend, prompts, max_new=60)
        assert backend.buckets == (1, 2, 4, 8) and backend._bucket(3) == 4 and backend.length_buckets == (64, 128)
        # Hold slots 0-4 so that the rows land in slots 5-7: bucket 8, five padding rows below them.
        holders = [backend.generate(request(prompt(4, 20 + i), GREEDY, max_new=1000, constrain=True)) for i in range(5)]
        for h in holders:
            await h.__anext__()
        streams = [backend.generate(request(p, GREEDY_PENALISED, max_new=60, constrain=True)) for p in prompts]
        firsts = [await s.__anext__() for s in streams]
        assert sorted(row.slot for row in backend._live.values()) == list(range(8))
        rest = await asyncio.gather(*(collect(s) for s in streams))
        high = [first + ids for first, (ids, _) in zip(firsts, rest, strict=True)]
        for h in holders:
            await h.aclose()
    assert alone == padded == eager == high
    assert all(len(ids) == 60 for ids in eager)  # positions 17..77: both length buckets


async def test_constrained_ids_follow_the_frame_layout(any_backend: HFBackend) -> None:
    backend = any_backend
    sampling = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=3)
    streams = [
        backend.generate(request(prompt(n, seed=n), sampling, max_new=5 * TOKENS_PER_FRAME, constrain=True))
        for n in (4, 11)
    ]
    for ids, finish in await asyncio.gather(*(collect(s) for s in streams)):
        assert finish in (FinishReason.STOP, FinishReason.LENGTH)
        for k, tok in enumerate(ids):
            assert tok in set(SPEC.allowed_ids(k % TOKENS_PER_FRAME).tolist()) and tok != SPEC.end_of_speech
        if finish == FinishReason.STOP:
            assert len(ids) % TOKENS_PER_FRAME == 0
        else:
            assert len(ids) == 5 * TOKENS_PER_FRAME


async def test_end_of_speech_only_at_a_frame_boundary(any_backend: HFBackend) -> None:
    """Make end of speech the model's favourite from the 10th step on: constrained, it waits for k == 0."""
    backend = any_backend
    logits, phase_logits, calls = backend.logits, backend.phase_logits, [0]
    eos_col = SPEC.audio_ids.index(SPEC.end_of_speech)

    def favour_eos(hidden: torch.Tensor, **kw: bool) -> torch.Tensor:
        out = logits(hidden, **kw)  # the reference variant's audio_only: its logits over the audio ids only
        calls[0] += 1
        if calls[0] > 10:
            out[:, eos_col if kw.get("audio_only") else SPEC.end_of_speech] += 100.0
        return out

    def favour_eos_column(hidden: torch.Tensor, phase: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        out = phase_logits(hidden, phase, *args, **kw)
        calls[0] += 1
        if calls[0] > 10:
            out[:, CODEBOOK_SIZE] += 100.0  # the -inf mask where the position does not allow it comes after
        return out

    backend.logits = favour_eos
    backend.phase_logits = favour_eos_column
    ids, finish = await collect(backend.generate(request(prompt(5, 1), GREEDY, max_new=100, constrain=True)))
    assert (len(ids), finish) == (14, FinishReason.STOP)
    calls[0] = 0
    ids, finish = await collect(backend.generate(request(prompt(5, 1), GREEDY, max_new=100, constrain=False)))
    assert (len(ids), finish) == (10, FinishReason.STOP)


async def test_seeded_request_reproduces(any_backend: HFBackend) -> None:
    backend = any_backend
    sampling = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, seed=1234)
    req = request(prompt(8, 5), sampling, max_new=21, constrain=True)
    first, _ = await collect(backend.generate(req))
    # Again, now batched with an unseeded request that draws from the shared generator.
    other = backend.generate(request(prompt(12, 6), SamplingParams(temperature=1.0), max_new=30, constrain=True))
    second, _ = await collect(backend.generate(req))
    await other.aclose()
    assert first == second and len(first) == 21
    reseeded = SamplingParams(temperature=0.6, seed=99)
    third, _ = await collect(backend.generate(request(prompt(8, 5), reseeded, max_new=21, constrain=True)))
    assert third != first


async def test_max_new_tokens_gives_length(backend: HFBackend) -> None:
    ids, finish = await collect(backend.generate(request(prompt(6, 2), SamplingParams(seed=1), max_new=9)))
    assert (len(ids), finish) == (9, FinishReason.LENGTH)
    assert backend.stats()["finish_length"] == 1


async def test_abort_frees_the_slot_within_one_step(backend: HFBackend) -> None:
    keep = backend.generate(request(prompt(3, 8), SamplingParams(seed=2), max_new=60, constrain=True))
    stream = backend.generate(request(prompt(7, 9), SamplingParams(seed=3), max_new=1000, constrain=True))
    await stream.__anext__()
    await stream.__anext__()
    await stream.aclose()
    ids, finish = await collect(keep)
    assert (len(ids), finish) == (60, FinishReason.LENGTH)
    for _ in range(100):
        if backend.stats()["live_requests"] == 0:
            break
        await asyncio.sleep(0.01)
    stats = backend.stats()
    assert stats["live_requests"] == 0 and stats["aborted"] == 1
    assert stats["max_steps_to_abort"] <= 1
    assert sorted(backend.free_slots) == list(range(backend.max_batch_size))


async def test_sequence_limits(backend: HFBackend) -> None:
    too_long = backend.generate(request(prompt(130, 1)))
    fits = backend.generate(request(prompt(118, 2), max_new=100))  # 118 + 6 prompt ids: room for 4 more
    with pytest.raises(BackendError, match="max_seq_len"):
        await collect(too_long)
    assert too_long.finish_reason == FinishReason.ERROR
    ids, finish = await collect(fits)
    assert (len(ids), finish) == (128 - 124, FinishReason.LENGTH)
    assert backend.stats()["live_requests"] == 0
    assert sorted(backend.free_slots) == list(range(backend.max_batch_size))


@pytest.mark.parametrize("variant", ["fast", "static"])
async def test_a_slot_reused_after_cancellation_starts_clean(orpheus_dir: str, variant: str) -> None:
    """One slot: a request cancelled mid-stream leaves no penalty state for the next one in its slot."""
    same = prompt(6, 30)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.5, seed=5)
    async with started(orpheus_dir, variant, max_batch_size=1) as backend:
        first = await greedy_constrained(backend, [same], max_new=40)
        seeded, _ = await collect(backend.generate(request(same, sampled, max_new=40, constrain=True)))
        doomed = backend.generate(request(same, GREEDY_PENALISED, max_new=1000, constrain=True))
        for _ in range(25):  # the same ids the next request will want: any leak would penalise them
            await doomed.__anext__()
        await doomed.aclose()
        assert await greedy_constrained(backend, [same], max_new=40) == first
        again, _ = await collect(backend.generate(request(same, sampled, max_new=40, constrain=True)))
        assert again == seeded
        assert backend.stats()["aborted"] == 1 and backend.free_slots == [0]


def test_admission_resets_the_slots_sampling_state(orpheus_dir: str) -> None:
    """The tables a reused slot starts from hold only the new prompt's ids and the new request's parameters."""
    backend = HFBackend(orpheus_dir, max_batch_size=1, max_seq_len=128)
    backend._load()
    cloning = audio_prompt(4, 3)
    row = backend._admit(request(cloning, SamplingParams(temperature=0.9, top_p=0.7, seed=8), constrain=True))
    marked = {(k, c) for k, c in backend.audio_seen[0].nonzero().tolist()}
    assert marked == {divmod(i - SPEC.first_audio_token, CODEBOOK_SIZE) for i in cloning if i >= SPEC.first_audio_token}
    for _ in range(9):
        backend._step([row])
    assert int(backend.audio_seen[0].sum()) > len(marked)
    backend._release(row)
    text = prompt(6, 4)
    backend._admit(request(text, SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.2), constrain=True))
    assert not backend.audio_seen[0].any()
    assert backend.seen[0].nonzero()[:, 0].tolist() == sorted(set(text))
    torch.testing.assert_close(backend.slot_sampling[0], torch.tensor([0.0, 1.0, 1.2]))


class RecordOps(TorchDispatchMode):
    """Names of the aten ops that run inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


HOST_READS = ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "equal")


def test_the_captured_step_never_reads_device_data_on_the_host(orpheus_dir: str) -> None:
    """What a CUDA graph captures (`_static_step`) and the eager CUDA step read nothing back but the ids."""
    backend = HFBackend(orpheus_dir, max_batch_size=4, max_seq_len=64, static_shapes=True)
    backend._load()
    rows = [
        backend._admit(request(prompt(n, n), SamplingParams(seed=n, top_p=0.9), max_new=50, constrain=True))
        for n in (3, 5, 8)
    ]
    for _ in range(3):
        backend._step(rows)
    length, meta = backend._static_meta(rows)
    with RecordOps() as ops:
        backend._static_step(meta, length)
    assert ops.names and not [n for n in ops.names if n.split(".")[0] in HOST_READS]
    assert "lift_fresh" not in {n.split(".")[0] for n in ops.names}  # no host value copied in (a capture fails)
    with RecordOps() as ops, torch.inference_mode():  # the eager step as on CUDA: branch free, one head product
        backend._decode(rows)
    assert not [n for n in ops.names if n.split(".")[0] in HOST_READS]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_paused_row_resumes_with_the_tokens_it_would_have_had(orpheus_dir: str, variant: str) -> None:
    """A live row left out of steps (the engine pauses a stream whose audio is unread) keeps its cache and
    penalty state: padding rows of a static bucket must not write into a live slot."""

    def run(pause: range) -> list[list[int]]:
        backend = variant_backend(orpheus_dir, variant, max_seq_len=64)
        backend._load()
        sampling = [SamplingParams(seed=n, top_p=0.9, repetition_penalty=1.3) for n in (1, 2)]
        rows = [backend._admit(request(prompt(4, n), s, max_new=40, constrain=True)) for n, s in enumerate(sampling)]
        got: list[list[int]] = [[], []]
        for step in range(16):
            live = [1] if step in pause else [0, 1]
            for i, (ids, _) in zip(live, backend._step([rows[i] for i in live])):
                got[i] += ids
        return got

    steady, paused = run(range(0)), run(range(3, 8))
    assert paused[0] == steady[0][: len(paused[0])] and len(paused[0]) == 11
    assert paused[1] == steady[1]


@pytest.mark.parametrize(
    ("device", "options", "graphs"),
    [
        ("cuda", {}, True),
        ("cpu", {}, False),
        ("cuda", {"cuda_graphs": False}, False),
    ],
)
def test_the_engine_captures_hf_steps_on_cuda_by_default(
    orpheus_dir: str, device: str, options: dict[str, Any], graphs: bool
) -> None:
    """On CUDA the eager step is launch-bound (H200: 50 ms a step, a quarter of real time): graphs by default."""
    from orpheus_tts_plugin.backends import make_backend
    from orpheus_tts_plugin.config import EngineConfig

    config = EngineConfig(model=orpheus_dir, backend_options=tuple(options.items()))
    backend = make_backend(config, SPEC, device)  # nothing is loaded until start(): no GPU needed here
    assert isinstance(backend, HFBackend) and backend.cuda_graphs is graphs
