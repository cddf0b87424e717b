"""Per-step host cost of each audio-constraint option, on the stand-in's code: `python -m tests.trtllm_standin.cost`.

Options, per engine step at R rows (requests), mid-utterance (a 40-id prompt plus 1,000 generated ids):
  position   one AudioPositionProcessor per request, dispatched as `_execute_logit_post_processors` does (history
             copy, signature check, call); logits on the CPU (the masked_fill runs here) and on the meta device (no
             arithmetic: the host's share of a GPU launch, minus the launch itself)
  union-lp   the same dispatch with one union mask (what a union processor would cost)
  dispatch   the same dispatch calling a processor that does nothing (upstream's share of `position`)
  union-bias >= 1.3 TorchSampler's embedding bias: R per-request rows stacked on the host every step (then copied to the
             GPU: R x vocab x 4 bytes, not measured here); on 1.2 with TRTLLMSampler this is 0 per step
Not in these figures: upstream's `get_tokens()` copies the history through the C++ bindings (~40 us at 2,048 ids by
its own comment in sampler/token_ban.py) where the stand-in copies a Python list.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from orpheus_tts_plugin.backends.trtllm import audio_bias
from orpheus_tts_plugin.backends.trtllm_logits import FORBIDDEN, AudioPositionProcessor
from orpheus_tts_plugin.tools.bench.common import host_line

from .api import SPEC, Request, SamplingParams, run_logits_processors
from .line12 import stack_biases

ROWS = (16, 64, 256)
PROMPT, GENERATED = 40, 1000


class UnionProcessor:
    """A processor that applies the union of all positions: the cost of the dispatch without the position logic."""

    masks: dict[str, torch.Tensor] = {}

    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id) -> None:  # noqa: ANN001 - upstream's signature
        key = str(logits.device)
        if key not in self.masks:
            forbid = torch.ones(logits.shape[-1], dtype=torch.bool)
            forbid[list(SPEC.audio_ids)] = False
            self.masks[key] = forbid.to(logits.device)
        logits.masked_fill_(self.masks[key], FORBIDDEN)


def _noop(req_id, logits, token_ids, stream_ptr, client_id) -> None:  # noqa: ANN001 - upstream's signature
    """A processor that does nothing: what upstream's dispatch alone costs."""


def _requests(rows: int, processor: Callable[[], object] | None = None, bias: bool = False) -> list[Request]:
    """`rows` worker-side requests, each with its own processor copy or its own bias row (as after pickling)."""
    shared = audio_bias(SPEC, SPEC.vocab_size)
    out = []
    for i in range(rows):
        params = SamplingParams(
            logits_processor=processor() if processor else None, embedding_bias=shared.clone() if bias else None
        )
        r = Request(i, list(range(PROMPT)), params)
        r.generated = [SPEC.audio_token(k % 7, 5) for k in range(GENERATED)]
        r.visible = GENERATED
        out.append(r)
    return out


def _ms(step: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(min, median) milliseconds of `step` over `repeat` runs, after one warm-up run (mask tables)."""
    step()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3, statistics.median(times) * 1e3


def measure(rows: int, repeat: int = 30) -> dict[str, tuple[float, float]]:
    """(min, median) host milliseconds per step of each option at `rows` rows."""
    result = {}
    for device in ("cpu", "meta"):
        logits = torch.zeros((rows, SPEC.vocab_size), device=device)
        pos = _requests(rows, lambda: AudioPositionProcessor(SPEC))
        result[f"position ({device})"] = _ms(lambda r=pos, x=logits: run_logits_processors(r, x), repeat)
        union = _requests(rows, UnionProcessor)
        result[f"union-lp ({device})"] = _ms(lambda r=union, x=logits: run_logits_processors(r, x), repeat)
    noop = _requests(rows, lambda: _noop)
    result["dispatch only"] = _ms(lambda: run_logits_processors(noop, logits), repeat)
    biased = _requests(rows, bias=True)
    result["union-bias stack (>=1.3)"] = _ms(lambda: stack_biases(biased, rows), repeat)
    return result


def main() -> None:
    torch.set_num_threads(1)
    print(host_line())
    print(f"history {PROMPT}+{GENERATED} ids, vocab {SPEC.vocab_size}; ms per step, min / median of 30 steps")
    table = {rows: measure(rows) for rows in ROWS}
    print(f"{'option':<26}" + "".join(f"{f'{r} rows':>18}" for r in ROWS))
    for name in table[ROWS[0]]:
        print(f"{name:<26}" + "".join(f"{table[r][name][0]:>10.2f} /{table[r][name][1]:>6.2f}" for r in ROWS))
    print("union-bias H2D per step (>=1.3), MB: " + ", ".join(f"{r * SPEC.vocab_size * 4 / 1e6:.1f}" for r in ROWS))


if __name__ == "__main__":
    main()
