"""The Orpheus per-frame-position audio constraint as a TensorRT-LLM `SamplingParams.logits_processor`.

At output index k only `spec.allowed_ids(k % 7)` survive (end of speech only between frames); every other logit is
set to FORBIDDEN. One processor object per request: the LLM API pickles each request's SamplingParams into the
executor worker (`executor/proxy.py` → `base_worker.py`), so the object the executor calls is that request's own
copy there, free to count that request's steps. A continuation after a pause (its stream's ids so far in its prompt)
gets `offset`, the number of those ids, so that k goes on from there.

Why it counts its own calls: the PyTorch backend calls each request's processors once per scheduled step
(`_execute_logit_post_processors`: every context chunk, then every generation step), but with the overlap scheduler
(the default) the `token_ids` it passes lack the token sampled in the previous step (NVIDIA/TensorRT-LLM#16785), and
it skips the call for a context request longer than its original prompt (one re-prefilled after an eviction). So:
without the overlap scheduler the history is current and alone gives the index; with it, the index is the call count
kept within what the history allows (the ids it shows, or one more), which puts a count that ran ahead (a prompt split
into chunks, each called) back on track by the next step. NOT run against TensorRT-LLM (no GPU here): tested on the
stand-in in tests/trtllm_standin/.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ..spec import TOKENS_PER_FRAME, ModelSpec

# exp(-1e4) is exactly 0 in fp32; unlike -inf it cannot become NaN in penalty or top-p kernels, and it fits fp16.
FORBIDDEN = -1.0e4

_tables: dict[tuple[int, int, int, str], torch.Tensor] = {}
_tables_lock = threading.Lock()


def forbidden_table(spec: ModelSpec, vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [7, vocab_size] on `device`: row p is True where an id is invalid at frame position p (cached)."""
    key = (spec.first_audio_token, spec.end_of_speech, vocab_size, str(device))
    table = _tables.get(key)
    if table is None:
        with _tables_lock:
            table = _tables.get(key)
            if table is None:
                if vocab_size < spec.audio_token_end:
                    raise ValueError(f"vocab_size {vocab_size} is smaller than the audio id range end")
                rows = torch.ones((TOKENS_PER_FRAME, vocab_size), dtype=torch.bool)
                for p in range(TOKENS_PER_FRAME):
                    rows[p, torch.from_numpy(spec.allowed_ids(p))] = False
                table = _tables[key] = rows.to(device)
    return table


class AudioPositionProcessor:
    """TensorRT-LLM LogitsProcessor (`tensorrt_llm.sampling_params.LogitsProcessor` signature) for one request."""

    def __init__(self, spec: ModelSpec, *, overlap: bool = True, offset: int = 0):
        self.spec = dataclasses.replace(spec)  # a fresh copy: cached properties do not ride along in each pickle
        self.overlap = overlap  # the executor runs the overlap scheduler: histories may be one token behind
        self.offset = offset  # ids generated before this request (a continuation after a pause): its first index
        self.calls = 0
        self.prompt_len: int | None = None

    def index(self, token_ids: list[list[int]]) -> int:
        """The output index of the token about to be sampled, counted from `offset`; counts this call."""
        seen = len(token_ids[0]) if token_ids else 0
        if self.prompt_len is None:
            self.prompt_len = seen  # the first call is a context step: the history is exactly the prompt
        shown = seen - self.prompt_len
        k = min(max(self.calls, shown), shown + 1) if self.overlap else shown
        self.calls = k + 1
        return self.offset + k

    def __call__(
        self,
        req_id: int,
        logits: torch.Tensor,
        token_ids: list[list[int]],
        stream_ptr: int | None,
        client_id: int | None,
    ) -> None:
        """Mask `logits` ([beams, 1, vocab], in place) to the ids valid at this request's next frame position."""
        k = self.index(token_ids)
        table = forbidden_table(self.spec, logits.shape[-1], logits.device)  # the lm_head's width, padding included
        logits.masked_fill_(table[k % TOKENS_PER_FRAME], FORBIDDEN)
