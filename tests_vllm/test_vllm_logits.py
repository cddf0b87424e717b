"""The per-position logits processor against vLLM's own BatchUpdate and SamplingParams, without an engine.

The V1 interface (the CPU platform's model runner) is also driven by real engines in the other modules here. The
V2 interface (CUDA's default model runner since vLLM 0.31) cannot run without a GPU: its arithmetic is checked with
a CPU stand-in for vLLM's UVA-backed tensors (vllm/v1/worker/gpu/buffer_utils.py UvaBackedTensor: a host array
`.np`, a device copy `.gpu` refreshed by `copy_to_uva()`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from orpheus_tts_plugin.backends import vllm_logits
from orpheus_tts_plugin.backends.vllm import AUDIO_OFFSET_ARG
from orpheus_tts_plugin.backends.vllm_logits import OrpheusAudioLogitsProcessor as Processor
from orpheus_tts_plugin.spec import ENGLISH

VOCAB = ENGLISH.vocab_size
ON = SamplingParams(extra_args=vllm_logits.extra_args(ENGLISH.first_audio_token, ENGLISH.end_of_speech))
OFF = SamplingParams()


def allowed(row: torch.Tensor) -> list[int]:
    """The ids a masked logits row still allows."""
    return torch.isfinite(row).nonzero().flatten().tolist()


def expected(k: int, first: int = ENGLISH.first_audio_token, eos: int = ENGLISH.end_of_speech) -> list[int]:
    """spec.allowed_ids at output index k, for other first/eos ids too."""
    lo = first + (k % 7) * 4096
    return sorted([*range(lo, lo + 4096), *([eos] if k % 7 == 0 else [])])


def batch(added=(), removed=(), moved=(), size: int = 4) -> BatchUpdate:
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def test_the_extra_args_keys_match_what_the_backends_send() -> None:
    keys = {"orpheus_audio": 1, "orpheus_first_audio_token": 1, "orpheus_end_of_speech": 2}
    assert vllm_logits.extra_args(1, 2) == keys
    assert vllm_logits.extra_args(1, 2, 9) == {**keys, AUDIO_OFFSET_ARG: 9}
    assert AUDIO_OFFSET_ARG == vllm_logits.OFFSET_ARG  # vllm.py's copy (it must not import this module)
    assert vllm_logits.FQCN == "orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor"
    defaults = SamplingParams(extra_args={"orpheus_audio": 1})  # its own copies of spec's ids (it imports no spec)
    assert vllm_logits.audio_ids_of(defaults) == (ENGLISH.first_audio_token, ENGLISH.end_of_speech)
    for k in range(7):
        assert sorted(map(int, ENGLISH.allowed_ids(k % 7))) == expected(k)  # the processor's rule is spec's


def test_each_opted_in_row_allows_exactly_the_ids_of_its_frame_position() -> None:
    p = Processor(None, torch.device("cpu"), False)
    outs: list[list[int]] = [[], [1] * 3, [1] * 7, []]
    p.update_state(batch([(i, OFF if i == 2 else ON, None, out) for i, out in enumerate(outs)]))
    logits = torch.zeros(4, VOCAB)
    assert p.apply(logits) is logits
    assert allowed(logits[0]) == expected(0) and allowed(logits[1]) == expected(3) and allowed(logits[3]) == expected(0)
    assert torch.isfinite(logits[2]).all()  # not opted in
    outs[0].append(5)  # vLLM appends each sampled id to the live list: the index moves on without a batch update
    p.update_state(None)
    logits = torch.zeros(4, VOCAB)
    p.apply(logits)
    assert allowed(logits[0]) == expected(1)


def test_rows_follow_swaps_moves_and_removals() -> None:
    p = Processor(None, torch.device("cpu"), False)
    outs: list[list[int]] = [[0] * 1, [0] * 3, [], [0] * 9]
    p.update_state(batch([(i, OFF if i == 2 else ON, None, out) for i, out in enumerate(outs)]))
    p.update_state(batch(moved=[(0, 2, MoveDirectionality.SWAP)]))
    logits = torch.zeros(4, VOCAB)
    p.apply(logits)
    assert torch.isfinite(logits[0]).all() and allowed(logits[2]) == expected(1)
    p.update_state(batch(removed=[3], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)], size=3))
    logits = torch.zeros(3, VOCAB)
    p.apply(logits)
    assert allowed(logits[0]) == expected(3) and torch.isfinite(logits[1]).all() and allowed(logits[2]) == expected(1)
    assert set(p.reqs) == {0, 2}


def test_a_continuation_s_offset_moves_its_frame_positions_on() -> None:
    p = Processor(None, torch.device("cpu"), False)
    cont = SamplingParams(extra_args=vllm_logits.extra_args(offset=10))  # 10 ids came before this request
    p.update_state(batch([(0, cont, None, []), (1, cont, None, [0] * 4)], size=2))
    logits = torch.zeros(2, VOCAB)
    p.apply(logits)
    assert allowed(logits[0]) == expected(10) and allowed(logits[1]) == expected(14)
    assert vllm_logits.audio_offset_of(cont) == 10 and vllm_logits.audio_offset_of(ON) == 0


def test_other_model_families_pass_their_own_ids() -> None:
    p = Processor(None, torch.device("cpu"), False)
    other = SamplingParams(extra_args=vllm_logits.extra_args(1000, 5))
    p.update_state(batch([(0, other, None, [0] * 14)], size=1))
    logits = torch.zeros(1, VOCAB)
    p.apply(logits)
    assert allowed(logits[0]) == expected(14, 1000, 5)


def test_the_masked_row_keeps_the_allowed_logits_values() -> None:
    p = Processor(None, torch.device("cpu"), False)
    p.update_state(batch([(0, ON, None, [0, 0])], size=1))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    p.apply(logits)
    ids = torch.tensor(expected(2))
    assert torch.equal(logits[0, ids], before[0, ids])


@pytest.mark.parametrize(
    "bad",
    [
        {"orpheus_audio": "yes"},
        {"orpheus_audio": 1, "orpheus_end_of_speech": "x"},
        {"orpheus_audio": 1, "orpheus_first_audio_token": -1},
        {"orpheus_audio": 1, "orpheus_first_audio_token": 1.5},
        {"orpheus_audio": 1, "orpheus_audio_offset": -3},
        {"orpheus_audio": 1, "orpheus_audio_offset": "7"},
    ],
)
def test_malformed_extra_args_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="extra_args"):
        Processor.validate_params(SamplingParams(extra_args=bad))


def test_requests_without_the_key_validate_and_are_not_constrained() -> None:
    Processor.validate_params(OFF)
    assert vllm_logits.audio_ids_of(OFF) is None
    assert vllm_logits.audio_ids_of(SamplingParams(extra_args={"orpheus_audio": 0})) is None


class CpuUva:
    """Stand-in for vllm/v1/worker/gpu/buffer_utils.py UvaBackedTensor on CPU (it needs pinned memory and CUDA)."""

    def __init__(self, size: int, dtype: torch.dtype, max_concurrency: int | None = None):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu.clone()

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        self.gpu = self.cpu.clone()
        return self.gpu


def test_the_v2_interface_masks_by_position_and_prompt_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOT a GPU run: V2 arithmetic on a CPU stand-in of req_states / LogitsContext (v1/worker/gpu/sample/...)."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils

    monkeypatch.setattr(buffer_utils, "UvaBackedTensor", CpuUva)
    prompt_len = torch.zeros(8, dtype=torch.int32)
    req_states = SimpleNamespace(max_num_reqs=8, prompt_len=SimpleNamespace(gpu=prompt_len))
    q = Processor(SimpleNamespace(), req_states)
    for slot, n in {5: 12, 2: 30, 7: 9, 3: 20}.items():
        prompt_len[slot] = n
    other = SamplingParams(extra_args=vllm_logits.extra_args(1000, 5))
    cont = SamplingParams(extra_args=vllm_logits.extra_args(offset=10))
    assert q.add_request(5, ON) and not q.add_request(2, OFF) and q.add_request(7, other) and q.add_request(3, cont)
    q.apply_staged_writes()
    idx = np.array([5, 2, 7, 3])
    # rows: slot 5 before its first output (pos 11 = prompt 12 - 1), slot 2 anything, slot 7 after 10 outputs,
    # slot 3 (a continuation of 10 ids) after 2 of its own
    ctx = SimpleNamespace(
        idx_mapping_np=idx,
        expanded_idx_mapping=torch.tensor(idx, dtype=torch.int32),
        pos=torch.tensor([11, 40, 18, 21], dtype=torch.int32),
    )
    logits = torch.zeros(4, VOCAB)
    q.apply(logits, ctx)
    assert allowed(logits[0]) == expected(0) and torch.isfinite(logits[1]).all()
    assert allowed(logits[2]) == expected(10, 1000, 5) and allowed(logits[3]) == expected(12)
