"""SNAC's decoder as streaming layers: each convolution keeps, as state, the inputs it still needs.

`build_layers(snac)` mirrors `snac.decoder.model` with its weights (read, never written). A layer is
called with the new inputs of a batch of utterances and a `Step` that knows each row's absolute position,
where each utterance ends, and the layer buffers gathered for the rows; layers take their buffers in a
fixed order (`Step.extend`) and leave the new ones in `Step.buffers_out`, in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gemm import FixedWeight
from .snac import LATENT_PER_FRAME, PositionalNoise


class Step:
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


def channel_mix(weight: FixedWeight, x: Tensor) -> Tensor:
    """A kernel-1 convolution: weight (out, in) applied to x (B, in, L), as the faster of two GEMM layouts.

    A large weight on short inputs (SNAC's first 768 → 1024 at 4 samples a frame) runs as one GEMM over all
    rows' columns, reading the weight once: `F.conv1d` and a broadcast matmul read it once per row (6× slower
    at 8 rows). Otherwise the per-row products are as fast and spare the two transposes.
    """
    b, c_in, n = x.shape
    c_out = weight.out_features
    if b == 1:
        return weight(x[0]).unsqueeze(0) if weight.uses_packed(n) else torch.matmul(weight.weight, x)
    if c_out * c_in < 32 * (c_in + c_out) * n:
        return torch.matmul(weight.weight, x)
    return weight(x.transpose(0, 1).reshape(c_in, b * n)).view(c_out, b, n).transpose(0, 1)


def _snake(x: Tensor, alpha: Tensor, inv_alpha: Tensor) -> Tensor:
    """SNAC's snake activation with one temporary instead of four."""
    y = torch.mul(x, alpha).sin_()
    return y.mul_(y).mul_(inv_alpha).add_(x)


class Layer:
    """One streaming layer; `in_channels`, `per_frame` and `delay` describe its input."""

    in_channels: int
    per_frame: int
    delay: int

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return []

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        raise NotImplementedError

    @property
    def out_per_frame(self) -> int:
        return self.per_frame

    @property
    def out_delay(self) -> int:
        return self.delay


class _Snake(Layer):
    def __init__(self, snake: nn.Module, per_frame: int, delay: int):
        self.alpha = snake.alpha.detach()
        self.inv_alpha = (self.alpha + 1e-9).reciprocal()
        self.in_channels = self.alpha.shape[1]
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        return _snake(x, self.alpha, self.inv_alpha)


class _Pointwise(Layer):
    """A kernel-1 convolution: no context, no state."""

    def __init__(self, conv: nn.Conv1d, per_frame: int, delay: int, packed: bool):
        self.gemm = FixedWeight(conv.weight.detach()[:, :, 0], packed=packed)  # (out, in)
        self.bias = None if conv.bias is None else conv.bias.detach().clone().view(1, -1, 1)
        self.in_channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        y = channel_mix(self.gemm, x)
        return y if self.bias is None else y.add_(self.bias)


class _Conv(Layer):
    """A 'same'-padded convolution streamed with the last `context` inputs as state.

    A dense convolution with few output channels (SNAC's last, 64 → 1) runs as one GEMM per kernel tap on
    shifted views of the window, summed: for one stream `F.conv1d` took 1.5–3.6× as long there (0.35–0.89 vs
    0.23–0.25 ms, docs/benchmarks.md; at 8 rows it was 20 % faster, no cliff); every other one is `F.conv1d`.
    """

    SHIFTED_MAX_OUT = 16  # at most this many output channels: shifted GEMMs

    def __init__(self, conv: nn.Conv1d, per_frame: int, delay: int):
        self.weight = conv.weight.detach().clone()
        self.bias = None if conv.bias is None else conv.bias.detach().clone()
        self.dilation, self.groups = conv.dilation[0], conv.groups
        self.context = self.dilation * (conv.kernel_size[0] - 1)
        if conv.stride[0] != 1 or 2 * conv.padding[0] != self.context:
            raise ValueError("streaming needs stride-1, symmetric 'same' padding")
        self.in_channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay
        self.taps: list[Tensor] | None = None
        if self.groups == 1 and conv.out_channels <= self.SHIFTED_MAX_OUT:
            self.taps = [self.weight[:, :, k].contiguous() for k in range(conv.kernel_size[0])]

    @property
    def out_delay(self) -> int:
        return self.delay + self.context // 2

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [(self.in_channels, self.context)]

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        window = step.extend(step.mask(x, self.per_frame, self.delay), self.context)
        if self.taps is None:
            return F.conv1d(window, self.weight, self.bias, dilation=self.dilation, groups=self.groups)
        n, d = x.shape[-1], self.dilation
        y = torch.matmul(self.taps[0], window[..., :n])
        for k in range(1, len(self.taps)):
            y.add_(torch.matmul(self.taps[k], window[..., k * d : k * d + n]))
        return y if self.bias is None else y.add_(self.bias.view(1, -1, 1))


class _ConvTranspose(Layer):
    """SNAC's upsampling transposed convolution (kernel 2·stride), streamed with one input of state.

    Run as one matmul and an overlap-add, not `F.conv_transpose1d`: with kernel 2·stride each input
    sample writes two output blocks of `stride` samples, so the output block j is the first half of
    input j's product plus the second half of input j-1's. One GEMM of all the rows' inputs against the
    weight (reshaped once here) reads the weight once a call, and takes the same time on every BLAS;
    `conv_transpose1d` at SNAC's short steady inputs falls off a kernel cliff on some hosts
    (131–141 ms a call for the first layer on an AMD EPYC, 24× its matmul; docs/benchmarks.md).
    """

    def __init__(self, conv: nn.ConvTranspose1d, per_frame: int, delay: int, packed: bool):
        self.stride, self.pad = conv.stride[0], conv.padding[0]
        if conv.kernel_size[0] != 2 * self.stride or conv.output_padding[0] != 0 or conv.groups != 1:
            raise ValueError("streaming needs kernel 2·stride, even stride, no groups")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        weight = conv.weight.detach()  # (in, out, 2·stride)
        # (out · 2·stride, in): row o·2s + k is output channel o at kernel tap k.
        self.gemm = FixedWeight(weight.reshape(self.in_channels, -1).t().contiguous(), packed=packed)
        bias = torch.zeros(self.out_channels) if conv.bias is None else conv.bias.detach()
        self.bias = bias.to(weight).clone().view(1, -1, 1)
        self.per_frame, self.delay = per_frame, delay

    @property
    def out_per_frame(self) -> int:
        return self.per_frame * self.stride

    @property
    def out_delay(self) -> int:
        return self.delay * self.stride + self.pad

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [(self.in_channels, 1)]

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        x = step.mask(x, self.per_frame, self.delay)
        b, n, s = x.shape[0], x.shape[-1], self.stride
        window = step.extend(x, 1)  # (B, in, n + 1)
        columns = window.transpose(0, 1).reshape(self.in_channels, b * (n + 1))
        taps = self.gemm(columns).view(self.out_channels, 2 * s, b, n + 1)
        blocks = taps[:, :s, :, 1:] + taps[:, s:, :, :-1]  # (out, s, B, n): output block j of each row
        return blocks.permute(2, 0, 3, 1).reshape(b, self.out_channels, n * s).add_(self.bias)


class _Noise(Layer):
    def __init__(self, noise: PositionalNoise, per_frame: int, delay: int, packed: bool):
        self.noise = noise
        self.gemm = FixedWeight(noise.linear.weight.detach()[:, :, 0], packed=packed)  # (out, in)
        self.in_channels = self.gemm.in_features
        self.per_frame, self.delay = per_frame, delay

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        pos = step.positions(self.per_frame, self.delay, x.shape[-1])
        return channel_mix(self.gemm, x).mul_(self.noise.noise(pos).unsqueeze(1)).add_(x)


class _Residual(Layer):
    """x + block(x), the skip path delayed by the block's look-ahead."""

    def __init__(self, unit: nn.Module, per_frame: int, delay: int, packed: bool):
        snake1, conv, snake2, pointwise = unit.block
        self.layers: list[Layer] = [_Snake(snake1, per_frame, delay), _Conv(conv, per_frame, delay)]
        inner_delay = self.layers[1].out_delay
        self.layers += [_Snake(snake2, per_frame, inner_delay), _Pointwise(pointwise, per_frame, inner_delay, packed)]
        self.lag = inner_delay - delay
        self.in_channels = conv.in_channels
        self.per_frame, self.delay = per_frame, delay

    @property
    def out_delay(self) -> int:
        return self.delay + self.lag

    def buffer_shapes(self) -> list[tuple[int, int]]:
        return [s for layer in self.layers for s in layer.buffer_shapes()] + [(self.in_channels, self.lag)]

    def __call__(self, x: Tensor, step: Step) -> Tensor:
        y = x
        for layer in self.layers:
            y = layer(y, step)
        skip = step.extend(x, self.lag)
        return y.add_(skip[..., : x.shape[-1]])


def build_layers(snac: nn.Module, packed: bool = True) -> list[Layer]:
    """Streaming layers mirroring snac.decoder.model, on its weights: the same tensors or reshaped copies.

    `packed`: large products at few columns run on a oneDNN-packed weight (`gemm.FixedWeight`); False (a
    compiled step) always `torch.mm`.
    """
    from snac.layers import DecoderBlock, ResidualUnit, Snake1d

    layers: list[Layer] = []
    per_frame, delay = LATENT_PER_FRAME, 0

    def add(layer: Layer) -> None:
        nonlocal per_frame, delay
        layers.append(layer)
        per_frame, delay = layer.out_per_frame, layer.out_delay

    for module in snac.decoder.model:
        if isinstance(module, DecoderBlock):
            for sub in module.block:
                if isinstance(sub, Snake1d):
                    add(_Snake(sub, per_frame, delay))
                elif isinstance(sub, nn.ConvTranspose1d):
                    add(_ConvTranspose(sub, per_frame, delay, packed))
                elif isinstance(sub, PositionalNoise):
                    add(_Noise(sub, per_frame, delay, packed))
                elif isinstance(sub, ResidualUnit):
                    add(_Residual(sub, per_frame, delay, packed))
                else:
                    raise ValueError(f"unexpected SNAC decoder block layer {type(sub).__name__}")
        elif isinstance(module, Snake1d):
            add(_Snake(module, per_frame, delay))
        elif isinstance(module, nn.Conv1d):
            add(
                _Pointwise(module, per_frame, delay, packed)
                if module.kernel_size[0] == 1
                else _Conv(module, per_frame, delay)
            )
        elif isinstance(module, nn.Tanh):
            continue  # applied by the decoder's step, after the last layer
        else:
            raise ValueError(f"unexpected SNAC decoder layer {type(module).__name__} (deterministic noise not set?)")
    return layers
