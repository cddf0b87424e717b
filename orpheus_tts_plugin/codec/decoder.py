"""Streaming SNAC decoding for the engine: the FrameDecoder interface, the pooled streaming decoder, the null one.

SNAC's decoder is convolutional and non-causal. `StreamingDecoder` runs it layer by layer (`layers.py`)
on new frames only, each convolution keeping the inputs it still needs as state, with inputs outside an
utterance masked to zero exactly as SNAC's offline zero padding: the streamed audio equals
`snac.offline_decode` of the whole utterance (up to float rounding), each frame decoded once.

Host work per call does not grow with the number of rows: each utterance's layer state lives in
preallocated device pools indexed by its slot; a call gathers the rows' slots, runs the layers and
scatters the new state back. Calls have static shapes from a small set of buckets (rows padded to a power
of two; chunks of 1 frame, of the first-chunk length, or that length plus the flush), so the step can be
compiled and, on CUDA, captured as one graph per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from ..spec import SAMPLES_PER_FRAME, TOKENS_PER_FRAME
from .codes import frames_to_levels
from .layers import Layer, Step, build_layers
from .snac import SNAC24_LATENCY, fade_edges, load_snac, to_int16

if TYPE_CHECKING:
    from ..config import EngineConfig


class FrameDecoder(Protocol):
    """What the engine's decoder thread drives (and only that thread): per-utterance states, decoded in batches."""

    first_chunk_frames: int
    ahead_chunk_frames: int  # frames of one utterance a call is best given when its stream is ahead (1: no gain)

    def new_state(self) -> DecodeState:
        """State for a new utterance; frames go into its `pending`, `final` marks its end."""
        ...

    def decode(self, states: Sequence[DecodeState]) -> list[np.ndarray | Exception]:
        """New int16 audio of each state, or the exception that failed it (its state is then unchanged)."""
        ...

    def release(self, state: DecodeState) -> None:
        """Free what `state` holds (an utterance dropped before its end)."""
        ...

    def stats(self) -> dict[str, object]: ...


@dataclass
class DecodeState:
    """One utterance as the decoder sees it: frames waiting, frames decoded, samples emitted, its pool slot."""

    frames_in: int = 0
    samples_out: int = 0
    final: bool = False
    pending: list[np.ndarray] = field(default_factory=list)  # (k, 7) code arrays not yet decoded, in order
    slot: int | None = None  # the decoder's pool slot while the utterance is being decoded

    @property
    def pending_frames(self) -> int:
        return sum(len(p) for p in self.pending)

    @property
    def done(self) -> bool:
        """Final and fully decoded: the last audio of the utterance has been returned (its slot given back)."""
        return self.final and not self.pending and self.slot is None

    def ready(self, first_chunk_frames: int) -> bool:
        """Whether a decode call for this utterance would emit audio (or end it) now."""
        if self.final:
            return True
        need = first_chunk_frames if self.frames_in == 0 else 1
        return self.pending_frames >= need

    def peek(self, n: int) -> np.ndarray:
        """The first `n` pending frames (n <= pending_frames), without consuming them."""
        if len(self.pending[0]) >= n:
            return self.pending[0][:n]
        return np.concatenate(self.pending)[:n]

    def consume(self, n: int) -> None:
        """Drop the first `n` pending frames (they have been decoded)."""
        while n:
            head = self.pending[0]
            if len(head) > n:
                self.pending[0] = head[n:]
                return
            n -= len(head)
            self.pending.pop(0)


@dataclass
class _Row:
    """One utterance's part in a call: `m` new frames, and whether its end (and flush) is in this call."""

    state: DecodeState
    m: int
    ends: bool


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _reserve_recompiles(entries: int) -> None:
    """Raise dynamo's per-function recompile limit by one entry per bucket of a new compiled decoder.

    Every decoder compiles the same `_step` code, and dynamo keeps at most `recompile_limit` (8) entries
    per code object, then silently runs the rest eagerly: a second engine in one process (a restart, a
    second voice) or a decoder with more buckets would otherwise lose compilation for some buckets.
    """
    config = torch._dynamo.config
    config.recompile_limit += entries
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * config.recompile_limit)


class StreamingDecoder:
    """Exact streaming SNAC decoding of up to `max_streams` utterances at once, in bucketed batched calls.

    Per utterance a call takes at most `first_chunk_frames` frames (the first chunk exactly that many):
    beyond 4 frames a call costs no less per frame on CPU and its memory grows with its length
    (docs/benchmarks.md), so a backlog is decoded over several calls, in order. Rows per call are bounded
    by `batch_frames` frames (rows × chunk length). `compile` runs the step through torch.compile;
    `cuda_graphs` (default: as `compile`, which it needs) replays each bucket as a CUDA graph on CUDA devices.
    Everything here runs on the engine's decoder thread (`new_state` excepted: it only builds a state).
    """

    def __init__(
        self,
        snac: nn.Module | None,
        first_chunk_frames: int = 4,
        *,
        max_streams: int = 64,
        batch_frames: int | None = None,
        compile: bool = False,
        cuda_graphs: bool | None = None,
    ):
        if first_chunk_frames < 1 or max_streams < 1:
            raise ValueError("first_chunk_frames and max_streams must be >= 1")
        if cuda_graphs and not compile:  # on an H200 the eager step's capture failed: it copies host indices in
            raise ValueError("cuda_graphs needs compile=True (the eager step cannot be captured)")
        self.first_chunk_frames = first_chunk_frames
        self.ahead_chunk_frames = first_chunk_frames  # a chunk length with its own buckets already
        self.snac = snac
        self.layers: list[Layer] = [] if snac is None else build_layers(snac, packed=not compile)
        self.latency_samples = self.layers[-1].out_delay if self.layers else SNAC24_LATENCY
        self.flush_frames = math.ceil(self.latency_samples / SAMPLES_PER_FRAME)
        self.warmup_frames = max(
            (math.ceil(layer.delay / layer.per_frame) for layer in self.layers), default=self.flush_frames
        )
        self.max_streams = max_streams
        self.batch_frames = batch_frames or _pow2_at_least(max_streams)
        # Chunk lengths: steady frames, first (and catch-up) chunks, and an utterance's last call, which holds
        # its last m <= first_chunk_frames frames and the flush in the shortest of these that fits.
        self.chunks = tuple(sorted({1, first_chunk_frames, self.flush_frames, first_chunk_frames + self.flush_frames}))
        # Steady 1-frame calls mask nothing once the first chunk has passed every layer's warm-up.
        self._mask_steady = first_chunk_frames < self.warmup_frames
        self._free = list(range(max_streams - 1, -1, -1))  # slot max_streams is the padding rows' scratch
        self._pools = self._make_pools()
        self._cuda_graphs = compile if cuda_graphs is None else cuda_graphs  # CUDA only
        self._step_fn: Callable[..., Tensor] = self._step
        if compile:
            _reserve_recompiles(len(self.buckets()))
            self._step_fn = torch.compile(self._step)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.calls = 0
        self.rows = 0
        self.padded_rows = 0
        self.frames = 0  # frames run through the layers, flush included, bucket padding not: each frame once
        self.calls_by_chunk: dict[int, int] = {}
        self.failed_calls = 0

    # ------------------------------------------------------------------ interface
    @property
    def device(self) -> torch.device:
        return next(self.snac.parameters()).device if self.snac is not None else torch.device("cpu")

    def new_state(self) -> DecodeState:
        return DecodeState()

    def release(self, state: DecodeState) -> None:
        if state.slot is not None:
            self._free.append(state.slot)
            state.slot = None

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, chunk frames) shape a call can have."""
        out = []
        for n in self.chunks:
            top = self._max_rows(n)
            out += [(1 << k, n) for k in range(top.bit_length()) if 1 << k <= top]
        return out

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Run every bucket once (compiling it, and on CUDA capturing its graph), so no call compiles later."""
        buckets = self.buckets()
        for i, (rows, n) in enumerate(buckets):
            with torch.inference_mode():
                self._launch(*self._padding_inputs(rows, n), n)
            if progress is not None:
                progress(i + 1, len(buckets))

    @torch.inference_mode()
    def decode(self, states: Sequence[DecodeState]) -> list[np.ndarray | Exception]:
        """Decode what each state allows now: new int16 audio per state (empty if none), or its exception.

        A first chunk takes exactly `first_chunk_frames` frames, even of an utterance that has already
        ended, so the first audio never waits for more decoding than it needs; the rest follows on later
        calls. A call that fails is retried row by row, so one bad row fails only its own utterance.
        """
        out: list[np.ndarray | Exception] = [_NO_AUDIO] * len(states)
        groups: dict[int, list[tuple[int, _Row]]] = {}
        for i, st in enumerate(states):
            row = self._plan(st)
            if row is None:
                continue
            n = min(c for c in self.chunks if c >= row.m + self.flush_frames) if row.ends else row.m
            groups.setdefault(n, []).append((i, row))
        for n, rows in groups.items():
            limit = self._max_rows(n)
            for lo in range(0, len(rows), limit):
                part = rows[lo : lo + limit]
                for (i, _), audio in zip(part, self._call_isolated([r for _, r in part], n)):
                    out[i] = audio
        return out

    def stats(self) -> dict[str, object]:
        return {
            "decoded_frames": self.frames,
            "decoder_calls": self.calls,
            "decoded_rows": self.rows,
            "decoder_padded_rows": self.padded_rows,
            "decoder_calls_by_chunk": dict(self.calls_by_chunk),
            "decoder_failed_calls": self.failed_calls,
            "decoder_free_slots": len(self._free),
        }

    # ------------------------------------------------------------------ planning
    def _plan(self, st: DecodeState) -> _Row | None:
        """This state's part in the next call, or None if it has nothing to decode now."""
        pending = st.pending_frames
        first = self.first_chunk_frames
        if st.final and pending <= first:
            if st.frames_in == 0 and pending == 0:
                return None  # an utterance without a single frame: nothing to say, already done
            return _Row(st, pending, ends=True)
        if st.frames_in == 0 or pending >= first:
            return _Row(st, first, ends=False) if pending >= first else None
        return _Row(st, 1, ends=False) if pending else None

    def _max_rows(self, n: int) -> int:
        """Rows of a call with `n`-frame chunks: a power of two, `batch_frames` frames in all at most."""
        rows = max(1, min(self.batch_frames // n, _pow2_at_least(self.max_streams)))
        return 1 << (rows.bit_length() - 1)

    # ------------------------------------------------------------------ calls
    def _call_isolated(self, rows: list[_Row], n: int) -> list[np.ndarray | Exception]:
        try:
            return list(self._call(rows, n))
        except Exception as exc:  # noqa: BLE001 - retried row by row below
            self.failed_calls += 1
            if len(rows) == 1:
                return [exc]
        return [self._call_isolated([row], n)[0] for row in rows]

    def _call(self, rows: list[_Row], n: int) -> list[np.ndarray]:
        """One bucketed call; commits each row's state only once the call has succeeded."""
        for row in rows:
            if row.state.slot is None:
                row.state.slot = self._free.pop()
        try:
            pcm, start, total = self._run(rows, n)
        except BaseException:
            for row in rows:
                if row.state.frames_in == 0:
                    self.release(row.state)
            raise
        out: list[np.ndarray] = []
        for k, row in enumerate(rows):
            st = row.state
            lo = max(0, -int(start[k]))
            hi = int(total[k] - start[k]) if row.ends else n * SAMPLES_PER_FRAME
            hi = max(lo, min(hi, n * SAMPLES_PER_FRAME))
            out.append(pcm[k, lo:hi])
            st.consume(row.m)
            st.frames_in += row.m
            st.samples_out += hi - lo
            if row.ends:
                self.release(st)
        self.calls += 1
        self.rows += len(rows)
        self.padded_rows += _pow2_at_least(len(rows)) - len(rows)
        self.frames += sum(r.m + (self.flush_frames if r.ends else 0) for r in rows)
        self.calls_by_chunk[n] = self.calls_by_chunk.get(n, 0) + 1
        return out

    def _run(self, rows: list[_Row], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int16 audio (B, n·2048) of the rows, and each row's first output position and length (-1: not ending)."""
        b = _pow2_at_least(len(rows))
        codes = np.zeros((b, n, TOKENS_PER_FRAME), dtype=np.int64)
        slots = np.full(b, self.max_streams, dtype=np.int64)
        fb = np.zeros(b, dtype=np.int64)
        end = np.zeros(b, dtype=np.int64)  # padding rows end before they start: all their inputs are masked
        for k, row in enumerate(rows):
            st = row.state
            if row.m:
                codes[k, : row.m] = st.peek(row.m)
            slots[k], fb[k] = st.slot, st.frames_in
            end[k] = st.frames_in + row.m if row.ends else _NEVER
        fresh = fb == 0
        fresh[len(rows) :] = True
        start = fb * SAMPLES_PER_FRAME - self.latency_samples
        total = np.where(end != _NEVER, end * SAMPLES_PER_FRAME, -1)
        pcm = self._launch(codes, slots, fb, end, fresh, n)
        return pcm.cpu().numpy(), start, total

    def _padding_inputs(self, rows: int, n: int) -> tuple[np.ndarray, ...]:
        """Inputs of a call whose rows are all padding (warm-up)."""
        z = np.zeros(rows, dtype=np.int64)
        return (np.zeros((rows, n, TOKENS_PER_FRAME), np.int64), z + self.max_streams, z, z, np.ones(rows, bool))

    def _launch(
        self, codes: np.ndarray, slots: np.ndarray, fb: np.ndarray, end: np.ndarray, fresh: np.ndarray, n: int
    ) -> Tensor:
        """Run the step for one bucket: replay its CUDA graph if it has one, else call the (compiled) step."""
        dev = self.device
        inputs = [torch.from_numpy(a) for a in (codes, slots, fb, end, fresh)]
        if dev.type == "cuda" and self._cuda_graphs:
            graph = self._graphs.get((len(slots), n))
            if graph is None:
                padding = [torch.from_numpy(a) for a in self._padding_inputs(len(slots), n)]
                graph = self._graphs[(len(slots), n)] = _Graph(self._step_fn, padding, dev, n != 1 or self._mask_steady)
            return graph.replay(inputs)
        return self._step_fn(*(t.to(dev) for t in inputs), mask=n != 1 or self._mask_steady)

    def _step(self, codes: Tensor, slots: Tensor, fb: Tensor, end: Tensor, fresh: Tensor, mask: bool) -> Tensor:
        """Gather the rows' layer state, run the layers, scatter the new state back: int16 audio (B, n·2048).

        Pure tensor code with static shapes (what torch.compile and CUDA graphs take).
        """
        if self.snac is None:
            return torch.zeros(codes.shape[0], codes.shape[1] * SAMPLES_PER_FRAME, dtype=torch.int16)
        keep = (~fresh).to(self._pools[0].dtype)[:, None, None]
        buffers = [pool.index_select(0, slots) * keep for pool in self._pools]
        x = self.snac.quantizer.from_codes(list(frames_to_levels(codes)))
        step = Step(fb, end, buffers, mask)
        for layer in self.layers:
            x = layer(x, step)
        for pool, new in zip(self._pools, step.buffers_out):
            pool.index_copy_(0, slots, new)
        start = fb * SAMPLES_PER_FRAME - self.latency_samples
        total = torch.where(end < _NEVER, end * SAMPLES_PER_FRAME, -1)
        return to_int16(fade_edges(torch.tanh(x[:, 0]), start, total))

    def _make_pools(self) -> list[Tensor]:
        """One (max_streams + 1, channels, context) tensor per layer buffer; the last slot is scratch."""
        if self.snac is None:
            return []
        param = next(self.snac.parameters())
        shapes = [s for layer in self.layers for s in layer.buffer_shapes()]
        return [torch.zeros(self.max_streams + 1, c, k, device=param.device, dtype=param.dtype) for c, k in shapes]


class _Graph:
    """One bucket's step captured as a CUDA graph: copy the inputs in, replay, read the static output.

    Warm-up and capture run on `padding` inputs (every row the scratch slot), as the step writes the rows'
    layer state: warming up on a real call's inputs would advance its streams' state twice more.
    """

    def __init__(self, step: Callable[..., Tensor], padding: list[Tensor], device: torch.device, mask: bool):
        self.static = [t.to(device) for t in padding]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (and compilation) outside the capture
                step(*self.static, mask=mask)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step(*self.static, mask=mask)

    def replay(self, inputs: list[Tensor]) -> Tensor:
        for dst, src in zip(self.static, inputs):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.out


class NullDecoder(StreamingDecoder):
    """Silence on the streaming decoder's exact schedule, with no model: measures everything else."""

    def __init__(self, first_chunk_frames: int = 4, *, max_streams: int = 64):
        super().__init__(None, first_chunk_frames, max_streams=max_streams)


def make_decoder(config: EngineConfig, device: str) -> FrameDecoder:
    """The decoder `config.decoder` names: "snac" (exact streaming) or "null" (silence on the same schedule)."""
    if config.decoder == "null":
        return NullDecoder(config.first_chunk_frames, max_streams=config.max_streams)
    snac = load_snac(config.snac, device, noise_seed=config.noise_seed)
    return StreamingDecoder(
        snac,
        config.first_chunk_frames,
        max_streams=config.max_streams,
        batch_frames=config.decode_batch_frames,
        compile=config.compile,
    )


_NEVER = np.iinfo(np.int64).max // (8 * SAMPLES_PER_FRAME)  # end_frames of an utterance whose end is not in a call
_NO_AUDIO = np.zeros(0, dtype=np.int16)
