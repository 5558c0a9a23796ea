"""Int8 GEMMs for prefill: int8 weights per output channel, activations quantized to int8 per
token at run time, for onnxruntime's `MatMulInteger` (MLAS's u8 x s8 kernels: on this AVX2 CPU
about 3x faster than prepacked fp32 `MatMul` at 512 rows, where `MatMulNBits` is slower than
fp32; benchmarks/bench_precision.py).

The graph (step_graph.py) computes, for x [..., in] and a weight packed by `quantize_channels`:
    s = max(max |x| over the row, TINY) / 127          (one scale per token)
    q = round(x / s) + 128 as uint8                      (zero point 128: |round(x / s)| <= 127)
    y = ((q - 128) @ data) * s * scales                  (int32 accumulation, exact)
Per-token scales keep the rows apart: one scale for the whole input (onnxruntime's
`DynamicQuantizeMatMul`, fbgemm's dynamic linear) lets one token's outliers flatten every
other token (SmolLM2: top-1 agreement 48% against 87% per token, docs/executor.md).
Channels whose activations run large (outliers) still flatten the rest of their token: given
the input's per-channel maxima on calibration text, `smoothing` moves part of that range into
the weight (SmoothQuant, Xiao et al. 2023): x / f is quantized against W * f, the same product.
`reference_linear` is the PyTorch reference of the same arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TINY = 1e-12   # a row of zeros gets a scale that stores it exactly (as zeros)
LIMIT = 127
# the share of an input channel's range moved into the weight (measured: docs/executor.md)
ALPHA = 0.8


@dataclass(frozen=True)
class ChannelInt8:
    """A [out, in] weight as MatMulInteger takes it: `data` int8 [in, out] (transposed) and
    `scales` fp32 [out], weight ~= data.T * scales[:, None] / smooth[None, :], where the input
    is multiplied by `inverse_smooth` = 1 / smooth [in] before it is quantized (None: 1)."""
    data: np.ndarray
    scales: np.ndarray
    inverse_smooth: np.ndarray | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[1]

    @property
    def in_features(self) -> int:
        return self.data.shape[0]


def smoothing(activation_max: torch.Tensor, weight: torch.Tensor,
              alpha: float | None = None) -> torch.Tensor:
    """Per input channel factors f = max |x|^alpha / max |W|^(1 - alpha) [in] of a [out, in]
    weight whose input's channels reached `activation_max` [in] (channels that never moved,
    or weights of zeros, keep 1)."""
    alpha = ALPHA if alpha is None else alpha
    weight_max = weight.detach().float().abs().amax(dim=0)
    factors = activation_max.float() ** alpha / weight_max ** (1 - alpha)
    usable = (activation_max > 0) & (weight_max > 0) & torch.isfinite(factors)
    return torch.where(usable, factors, torch.ones_like(factors))


def quantize_channels(weight: torch.Tensor, smooth: torch.Tensor | None = None) -> ChannelInt8:
    """Symmetric int8 per output channel (row) of a [out, in] fp32 weight, its input channels
    scaled by `smooth` [in] first (`smoothing`; None: not scaled)."""
    weight = weight.detach().float()
    if smooth is not None:
        weight = weight * smooth[None, :]
    scales = weight.abs().amax(dim=1) / LIMIT
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    data = torch.clamp(torch.round(weight / scales[:, None]), -LIMIT, LIMIT).to(torch.int8)
    inverse = None if smooth is None else (1 / smooth.float()).contiguous().numpy()
    return ChannelInt8(data.T.contiguous().numpy(), scales.contiguous().numpy(), inverse)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in [-127, 127] as fp32, scale per row [..., 1]) of x [..., in]."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(TINY) / LIMIT
    return torch.clamp(torch.round(x / scale), -LIMIT, LIMIT), scale


def reference_linear(x: torch.Tensor, packed: ChannelInt8) -> torch.Tensor:
    """What the graph's per-token int8 linear computes, in PyTorch (fp64 accumulation: exact
    for int8 products at these sizes)."""
    x = x.float()
    if packed.inverse_smooth is not None:
        x = x * torch.from_numpy(packed.inverse_smooth)
    values, scale = quantize_tokens(x)
    data = torch.from_numpy(packed.data).double()
    out = (values.double() @ data).float() * scale
    return out * torch.from_numpy(packed.scales)


def dequantize(packed: ChannelInt8) -> torch.Tensor:
    """The fp32 [out, in] weight `packed` stands for."""
    weight = (torch.from_numpy(packed.data).float() * torch.from_numpy(packed.scales)).T
    if packed.inverse_smooth is not None:
        weight = weight * torch.from_numpy(packed.inverse_smooth)[None, :]
    return weight.contiguous()
