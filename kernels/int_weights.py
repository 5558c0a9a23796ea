"""Integer weights for onnxruntime's `MatMulNBits` (MLAS kernels: the fast int8 / int4 GEMV on
CPUs without AVX-512, where torch's own weight-only int ops are slower than fp32).

`quantize(weight, bits, block_size)` packs a [out, in] fp32 weight group-wise: each block of
`block_size` inputs of an output row gets an fp32 scale, and the stored values (unsigned, two
4-bit values per byte, low nibble first) stand for (value - 2^(bits-1)) * scale, MatMulNBits'
default zero point.
- symmetric (int8): scale = max |w| / (2^(bits-1) - 1);
- asymmetric (int4): the block's range [min, max] in 2^bits steps, and an fp32 `offset` per
  block added back as offset * (sum of the block's inputs), a small second matmul. A block of
  a GGUF Q4_1 tensor (values d * q + m) comes back exactly, which MatMulNBits' integer zero
  points cannot do (and its float zero points have no fast CPU kernel).
`dequantize` is the PyTorch reference: the fp32 weight the packed one stands for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LEVELS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK = 32


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight as MatMulNBits takes it: `data` uint8
    [out, blocks, block_size * bits / 8], `scales` fp32 [out * blocks], and for asymmetric
    blocks `offsets` fp32 [out, blocks]."""
    data: np.ndarray
    scales: np.ndarray
    bits: int
    block_size: int
    out_features: int
    in_features: int
    offsets: np.ndarray | None = None
    inverse_smooth: np.ndarray | None = None   # [in]: the input is multiplied by it first

    @property
    def blocks(self) -> int:
        return -(-self.in_features // self.block_size)


def quantize(weight: torch.Tensor, bits: int, block_size: int = DEFAULT_BLOCK,
             symmetric: bool | None = None, smooth: torch.Tensor | None = None) -> PackedWeight:
    """Group-wise quantization of a [out, in] weight (in padded with zeros to whole blocks);
    `symmetric` defaults to True for 8 bits, False for 4. With `smooth` [in]
    (token_int8.smoothing), the weight's input channels are multiplied by it first and the
    graph divides its input by it: int8 activations then lose less to outlier channels."""
    if bits not in LEVELS.values():
        raise ValueError(f"bits must be one of {sorted(LEVELS.values())}, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    symmetric = bits == 8 if symmetric is None else symmetric
    out_features, in_features = weight.shape
    if smooth is not None:
        weight = weight.detach().float() * smooth[None, :]
    blocks = -(-in_features // block_size)
    padded = torch.zeros(out_features, blocks * block_size, dtype=torch.float32)
    padded[:, :in_features] = weight.detach().float()
    grouped = padded.view(out_features, blocks, block_size)
    middle = 2 ** (bits - 1)
    offsets = None
    if symmetric:
        scales = _nonzero(grouped.abs().amax(dim=-1, keepdim=True) / (middle - 1))
        values = torch.clamp(torch.round(grouped / scales), -middle, middle - 1) + middle
    else:
        low, high = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
        scales = _nonzero((high - low) / (2 ** bits - 1))
        values = torch.clamp(torch.round((grouped - low) / scales), 0, 2 ** bits - 1)
        offsets = (low + middle * scales).reshape(out_features, blocks).contiguous().numpy()
    values = values.to(torch.uint8)
    if bits == 4:
        values = values[..., 0::2] | (values[..., 1::2] << 4)
    inverse = None if smooth is None else (1 / smooth.float()).contiguous().numpy()
    return PackedWeight(values.contiguous().numpy(), scales.reshape(-1).contiguous().numpy(),
                        bits, block_size, out_features, in_features, offsets, inverse)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """A block of equal values gets scale 1 (any scale stores it exactly)."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The fp32 [out, in] weight `packed` stands for (what the graph computes with)."""
    data = torch.from_numpy(packed.data)
    if packed.bits == 4:
        data = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2)
    values = data.to(torch.float32).view(packed.out_features, packed.blocks, packed.block_size)
    scales = torch.from_numpy(packed.scales).view(packed.out_features, -1, 1)
    full = (values - 2 ** (packed.bits - 1)) * scales
    if packed.offsets is not None:
        full = full + torch.from_numpy(packed.offsets)[..., None]
    full = full.reshape(packed.out_features, -1)[:, :packed.in_features]
    if packed.inverse_smooth is not None:
        full = full * torch.from_numpy(packed.inverse_smooth)[None, :]
    return full.contiguous()


def reference_linear(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """x [..., in] @ dequantize(packed)^T: what the graph's int linear computes."""
    return torch.nn.functional.linear(x, dequantize(packed))
