"""Streaming SNAC decoding for the engine: the FrameDecoder interface, exact streaming, the null decoder.

The SNAC decoder is convolutional and non-causal. `StreamingDecoder` runs it layer by layer on
new frames only: every convolution keeps the last inputs it needs as state, so each frame is
decoded once and each output sample is emitted as soon as the receptive field allows. Inputs
outside an utterance are masked to zero, exactly as the offline decoder's zero padding, so the
streamed audio equals `snac.offline_decode` of the whole utterance (up to float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .codes import frames_to_levels
from .snac import LATENT_PER_FRAME, SNAC24_LATENCY, PositionalNoise, fade_edges, load_snac, to_int16
from .spec import SAMPLES_PER_FRAME

if TYPE_CHECKING:
    from .config import EngineConfig


class FrameDecoder(Protocol):
    """What the engine's decoder thread drives: per-utterance states, decoded in batches."""

    first_chunk_frames: int

    def new_state(self) -> DecodeState: ...

    def decode(self, states: Sequence[DecodeState]) -> list[np.ndarray]: ...

    def stats(self) -> dict[str, object]: ...


@dataclass
class DecodeState:
    """Streaming state of one utterance: frames seen, samples emitted, per-layer buffers."""

    frames_in: int = 0
    samples_out: int = 0
    final: bool = False
    buffers: list[Tensor] | None = None
    pending: list[np.ndarray] = field(default_factory=list)

    @property
    def pending_frames(self) -> int:
        return sum(len(p) for p in self.pending)

    @property
    def done(self) -> bool:
        """Final and fully decoded: the last audio of the utterance has been returned."""
        return self.final and not self.pending

    def ready(self, first_chunk_frames: int) -> bool:
        """Whether a decode call for this utterance would emit audio now."""
        if self.final:
            return True
        need = first_chunk_frames if self.frames_in == 0 else 1
        return self.pending_frames >= need


@dataclass
class _Batch:
    """One batched decoder call: B utterances, each with a chunk padded to n frames."""

    states: list[DecodeState]
    ends: np.ndarray  # (B,) bool: the utterance ends in this call (its chunk is followed by the flush)
    frames: np.ndarray  # (B, n, 7) codes; flush padding past a chunk's frames
    frames_before: np.ndarray  # (B,) frames each utterance had decoded before this call
    end_frames: np.ndarray  # (B,) frames in the utterance where its end is in this call, else a huge number
    start: np.ndarray  # (B,) absolute sample position of the call's first output sample
    total: np.ndarray  # (B,) utterance length in samples where it ends in this call, else -1
    need_mask: bool  # some input lies outside its utterance (start or end)

    @classmethod
    def of(
        cls, states: list[DecodeState], chunks: list[np.ndarray], ends: list[bool], n: int, latency: int, warmup: int
    ) -> _Batch:
        frames = np.zeros((len(states), n, 7), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            frames[row, : len(chunk)] = chunk
        fb = np.array([st.frames_in for st in states], dtype=np.int64)
        m = np.array([len(c) for c in chunks], dtype=np.int64)
        final = np.array(ends, dtype=bool)
        return cls(
            states=states,
            ends=final,
            frames=frames,
            frames_before=fb,
            end_frames=np.where(final, fb + m, np.iinfo(np.int64).max // (4 * SAMPLES_PER_FRAME)),
            start=fb * SAMPLES_PER_FRAME - latency,
            total=np.where(final, (fb + m) * SAMPLES_PER_FRAME, -1),
            need_mask=bool(final.any() or fb.min() < warmup),
        )


class _Step:
    """What one batched call knows about its rows: positions, utterance ends, layer buffers."""

    def __init__(self, frames_before: Tensor, end_frames: Tensor, buffers: list[Tensor], need_mask: bool):
        self.frames_before = frames_before  # (B,)
        self.end_frames = end_frames  # (B,) frames in the utterance, or a huge number if unknown
        self.buffers_in = buffers
        self.buffers_out: list[Tensor] = []
        self.need_mask = need_mask

    def positions(self, per_frame: int, delay: int, n: int) -> Tensor:
        """Absolute positions (B, n) at a layer with `per_frame` samples a frame and `delay`."""
        start = self.frames_before * per_frame - delay
        return start.unsqueeze(1) + torch.arange(n, device=start.device)

    def mask(self, x: Tensor, per_frame: int, delay: int) -> Tensor:
        """Zero the inputs that lie outside the utterance (the offline decoder's zero padding)."""
        if not self.need_mask:
            return x
        pos = self.positions(per_frame, delay, x.shape[-1])
        valid = (pos >= 0) & (pos < (self.end_frames * per_frame).unsqueeze(1))
        return x * valid.unsqueeze(1).to(x.dtype)

    def extend(self, x: Tensor, keep: int) -> Tensor:
        """Prepend this layer's buffer to `x` and keep the last `keep` samples as its next buffer.

        Layers call this in a fixed order, which is the order of their buffers.
        """
        window = torch.cat([self.buffers_in[len(self.buffers_out)], x], -1)
        self.buffers_out.append(window[..., window.shape[-1] - keep :])
        return window


def _snake(x: Tensor, alpha: Tensor, inv_alpha: Tensor) -> Tensor:
    """SNAC's snake activation with one temporary instead of four."""
    y = torch.mul(x, alpha).sin_()
    return y.mul_(y).mul_(inv_alpha).add_(x)


class _Layer:
    """One streaming layer; `per_frame` and `delay` describe its input."""

    per_frame: int
    delay: int

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return []

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        raise NotImplementedError

    @property
    def out_per_frame(self) -> int:
        return self.per_frame

    @property
    def out_delay(self) -> int:
        return self.delay


class _Snake(_Layer):
    def __init__(self, snake: nn.Module, per_frame: int, delay: int):
        self.alpha = snake.alpha.detach()
        self.inv_alpha = (self.alpha + 1e-9).reciprocal()
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        return _snake(x, self.alpha, self.inv_alpha)


class _Pointwise(_Layer):
    """A kernel-1 convolution: no context, no state."""

    def __init__(self, conv: nn.Conv1d, per_frame: int, delay: int):
        self.weight = conv.weight.detach().clone()
        self.bias = None if conv.bias is None else conv.bias.detach().clone()
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        return F.conv1d(x, self.weight, self.bias)


class _Conv(_Layer):
    """A 'same'-padded convolution streamed with the last `context` inputs as state."""

    def __init__(self, conv: nn.Conv1d, per_frame: int, delay: int):
        self.weight = conv.weight.detach().clone()
        self.bias = None if conv.bias is None else conv.bias.detach().clone()
        self.dilation, self.groups = conv.dilation[0], conv.groups
        self.context = self.dilation * (conv.kernel_size[0] - 1)
        if conv.stride[0] != 1 or 2 * conv.padding[0] != self.context:
            raise ValueError("streaming needs stride-1, symmetric 'same' padding")
        self.channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay

    @property
    def out_delay(self) -> int:
        return self.delay + self.context // 2

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [(self.channels, self.context)]

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        window = step.extend(step.mask(x, self.per_frame, self.delay), self.context)
        return F.conv1d(window, self.weight, self.bias, dilation=self.dilation, groups=self.groups)


class _ConvTranspose(_Layer):
    """SNAC's upsampling transposed convolution (kernel 2·stride), streamed with one input of state."""

    def __init__(self, conv: nn.ConvTranspose1d, per_frame: int, delay: int):
        self.weight = conv.weight.detach().clone()
        self.bias = None if conv.bias is None else conv.bias.detach().clone()
        self.stride, self.pad = conv.stride[0], conv.padding[0]
        if conv.kernel_size[0] != 2 * self.stride or conv.output_padding[0] != 0 or conv.groups != 1:
            raise ValueError("streaming needs kernel 2·stride, even stride, no groups")
        self.channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay

    @property
    def out_per_frame(self) -> int:
        return self.per_frame * self.stride

    @property
    def out_delay(self) -> int:
        return self.delay * self.stride + self.pad

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [(self.channels, 1)]

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        x = step.mask(x, self.per_frame, self.delay)
        n = x.shape[-1]
        window = step.extend(x, 1)
        y = F.conv_transpose1d(window, self.weight, self.bias, stride=self.stride)
        return y[..., self.stride : (n + 1) * self.stride]


class _Noise(_Layer):
    def __init__(self, noise: PositionalNoise, per_frame: int, delay: int):
        self.noise = noise
        self.weight = noise.linear.weight.detach().clone()
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        pos = step.positions(self.per_frame, self.delay, x.shape[-1])
        return F.conv1d(x, self.weight).mul_(self.noise.noise(pos).unsqueeze(1)).add_(x)


class _Residual(_Layer):
    """x + block(x), the skip path delayed by the block's look-ahead."""

    def __init__(self, unit: nn.Module, per_frame: int, delay: int):
        snake1, conv, snake2, pointwise = unit.block
        self.layers: list[_Layer] = [_Snake(snake1, per_frame, delay), _Conv(conv, per_frame, delay)]
        inner_delay = self.layers[1].out_delay
        self.layers += [_Snake(snake2, per_frame, inner_delay), _Pointwise(pointwise, per_frame, inner_delay)]
        self.lag = inner_delay - delay
        self.channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay

    @property
    def out_delay(self) -> int:
        return self.delay + self.lag

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [s for layer in self.layers for s in layer.buffer_shapes()] + [(self.channels, self.lag)]

    def __call__(self, x: Tensor, step: _Step) -> Tensor:
        y = x
        for layer in self.layers:
            y = layer(y, step)
        skip = step.extend(x, self.lag)
        return y.add_(skip[..., : x.shape[-1]])


class StreamingDecoder:
    """Exact streaming SNAC decoding of many utterances, one batched call per chunk length a tick."""

    def __init__(self, snac: nn.Module | None, first_chunk_frames: int = 4):
        if first_chunk_frames < 1:
            raise ValueError("first_chunk_frames must be >= 1")
        self.first_chunk_frames = first_chunk_frames
        self.snac = snac
        self.layers: list[_Layer] = [] if snac is None else _build_layers(snac)
        self.latency_samples = self.layers[-1].out_delay if self.layers else SNAC24_LATENCY
        self.flush_frames = math.ceil(self.latency_samples / SAMPLES_PER_FRAME)
        self.warmup_frames = max(
            (math.ceil(layer.delay / layer.per_frame) for layer in self.layers), default=self.flush_frames
        )
        self.calls = 0
        self.rows = 0
        self.frames = 0  # frames run through the layers, flush padding included: each frame once
        self.calls_by_chunk: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return next(self.snac.parameters()).device if self.snac is not None else torch.device("cpu")

    def new_state(self) -> DecodeState:
        return DecodeState()

    @torch.inference_mode()
    def decode(self, states: Sequence[DecodeState]) -> list[np.ndarray]:
        """Decode the pending frames of `states` (flushing the final ones): new int16 audio of each.

        A first chunk takes exactly `first_chunk_frames` frames, however many are waiting (even
        of an utterance that has already ended), so the first audio is never delayed by decoding
        more than it needs; the rest follows on the next call. `DecodeState.done` says when an
        utterance's last audio has been returned.
        """
        out: list[np.ndarray] = [_NO_AUDIO] * len(states)
        groups: dict[int, list[tuple[int, np.ndarray, bool]]] = {}
        for i, st in enumerate(states):
            frames = np.concatenate(st.pending) if st.pending else _NO_FRAMES
            st.pending.clear()
            if st.frames_in == 0 and len(frames) > self.first_chunk_frames:
                frames, rest = frames[: self.first_chunk_frames], frames[self.first_chunk_frames :]
                st.pending.append(rest)
            ends = st.done
            if ends and st.frames_in + len(frames) == 0:
                continue
            n = len(frames) + (self.flush_frames if ends else 0)
            if n:
                groups.setdefault(n, []).append((i, frames, ends))
        for n, rows in groups.items():
            audio = self._decode_group(
                [states[i] for i, _, _ in rows], [f for _, f, _ in rows], [e for *_, e in rows], n
            )
            for (i, _, _), a in zip(rows, audio):
                out[i] = a
        return out

    def _decode_group(
        self, states: list[DecodeState], chunks: list[np.ndarray], ends: list[bool], n: int
    ) -> list[np.ndarray]:
        batch = _Batch.of(states, chunks, ends, n, self.latency_samples, self.warmup_frames)
        pcm, buffers = self._run(batch)
        self.calls += 1
        self.rows += len(states)
        self.frames += n * len(states)
        self.calls_by_chunk[n] = self.calls_by_chunk.get(n, 0) + 1
        out: list[np.ndarray] = []
        for row, st in enumerate(states):
            lo = max(0, -int(batch.start[row]))
            hi = int(batch.total[row] - batch.start[row]) if batch.ends[row] else n * SAMPLES_PER_FRAME
            hi = max(lo, min(hi, n * SAMPLES_PER_FRAME))
            out.append(pcm[row, lo:hi])
            st.frames_in += len(chunks[row])
            st.samples_out += hi - lo
            st.buffers = None if batch.ends[row] else [b[row : row + 1] for b in buffers]
        return out

    def _run(self, batch: _Batch) -> tuple[np.ndarray, list[Tensor]]:
        """Run the layers on the batch's frames: int16 audio (B, n·2048), faded, and the new layer buffers."""
        device, dtype = self.device, next(self.snac.parameters()).dtype
        for st in batch.states:
            if st.buffers is None:
                st.buffers = [torch.zeros(1, c, k, device=device, dtype=dtype) for c, k in self._shapes()]
        buffers = [torch.cat(col) for col in zip(*(st.buffers for st in batch.states))]
        codes = [torch.from_numpy(c).to(device) for c in frames_to_levels(batch.frames)]
        x = self.snac.quantizer.from_codes(codes)
        fb, end = torch.from_numpy(batch.frames_before).to(device), torch.from_numpy(batch.end_frames).to(device)
        step = _Step(fb, end, buffers, batch.need_mask)
        for layer in self.layers:
            x = layer(x, step)
        start, total = torch.from_numpy(batch.start).to(device), torch.from_numpy(batch.total).to(device)
        return to_int16(fade_edges(torch.tanh(x[:, 0]), start, total)).cpu().numpy(), step.buffers_out

    def _shapes(self) -> list[tuple[int, int]]:
        return [s for layer in self.layers for s in layer.buffer_shapes()]

    def stats(self) -> dict[str, object]:
        return {
            "decoded_frames": self.frames,
            "decoder_calls": self.calls,
            "decoded_rows": self.rows,
            "decoder_calls_by_chunk": dict(self.calls_by_chunk),
        }


class NullDecoder(StreamingDecoder):
    """Silence on the streaming decoder's exact schedule, with no model: measures everything else."""

    def __init__(self, first_chunk_frames: int = 4):
        super().__init__(None, first_chunk_frames)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _run(self, batch: _Batch) -> tuple[np.ndarray, list[Tensor]]:
        return np.zeros((len(batch.states), batch.frames.shape[1] * SAMPLES_PER_FRAME), dtype=np.int16), []


_NO_AUDIO = np.zeros(0, dtype=np.int16)
_NO_FRAMES = np.zeros((0, 7), dtype=np.int64)


def _build_layers(snac: nn.Module) -> list[_Layer]:
    """Streaming layers mirroring snac.decoder.model, sharing its weights."""
    from snac.layers import DecoderBlock, ResidualUnit, Snake1d

    layers: list[_Layer] = []
    per_frame, delay = LATENT_PER_FRAME, 0

    def add(layer: _Layer) -> None:
        nonlocal per_frame, delay
        layers.append(layer)
        per_frame, delay = layer.out_per_frame, layer.out_delay

    for module in snac.decoder.model:
        if isinstance(module, DecoderBlock):
            for sub in module.block:
                if isinstance(sub, Snake1d):
                    add(_Snake(sub, per_frame, delay))
                elif isinstance(sub, nn.ConvTranspose1d):
                    add(_ConvTranspose(sub, per_frame, delay))
                elif isinstance(sub, PositionalNoise):
                    add(_Noise(sub, per_frame, delay))
                elif isinstance(sub, ResidualUnit):
                    add(_Residual(sub, per_frame, delay))
                else:
                    raise ValueError(f"unexpected SNAC decoder block layer {type(sub).__name__}")
        elif isinstance(module, Snake1d):
            add(_Snake(module, per_frame, delay))
        elif isinstance(module, nn.Conv1d):
            add(_Pointwise(module, per_frame, delay) if module.kernel_size[0] == 1 else _Conv(module, per_frame, delay))
        elif isinstance(module, nn.Tanh):
            continue  # applied at the end of _run
        else:
            raise ValueError(f"unexpected SNAC decoder layer {type(module).__name__} (deterministic noise not set?)")
    return layers


def make_decoder(config: EngineConfig, device: str) -> FrameDecoder:
    """The decoder `config.decoder` names: "snac" (exact streaming) or "null" (silence on the same schedule)."""
    if config.decoder == "null":
        return NullDecoder(config.first_chunk_frames)
    snac = load_snac(config.snac, device, noise_seed=config.noise_seed)
    return StreamingDecoder(snac, config.first_chunk_frames)
