"""GELU with bias: `gelu(x + bias)`, erf form (BERT, "gelu") or tanh form (GPT-2, "gelu_new").

Reference: torch.nn.functional.gelu(approximate="none" | "tanh"); transformers' NewGELUActivation
is the tanh formula.

Triton (`gelu_bias_triton`, the CUDA implementation): bias add and GELU in fp32, one cast to the
output dtype (the reference rounds `x + bias` to the input dtype first: up to one ulp apart in
bf16 / fp16); tanh as `1 - 2 / (exp(2u) + 1)`, u clamped to +-20.
"""
from typing import Optional

import torch

from rbcompile.kernels._triton import cast, interpreting, rows, tile_offsets, tl, triton, vector
from rbcompile.kernels.configs import tiles
from rbcompile.kernels.registry import kernel_op


def gelu_bias_reference(x: torch.Tensor, bias: Optional[torch.Tensor],
                        approximate: str) -> torch.Tensor:
    return torch.nn.functional.gelu(x if bias is None else x + bias, approximate=approximate)


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows"])
    def _gelu_bias_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, x_stride, HAS_BIAS: tl.constexpr,
                          TANH: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          RTNE: tl.constexpr):
        row, col, mask = tile_offsets(n_rows, n_cols, BLOCK_ROWS, BLOCK_N)
        row64 = row.to(tl.int64)[:, None]
        x = tl.load(x_ptr + row64 * x_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(b_ptr + col, mask=col < n_cols, other=0.0).to(tl.float32)[None, :]
        if TANH:
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi)
            u = tl.minimum(tl.maximum(u, -20.0), 20.0)  # tanh(+-20) is +-1 in fp32; no exp overflow
            y = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))  # 1 + tanh(u)
        else:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        tl.store(out_ptr + row64 * n_cols + col[None, :], cast(y, out_ptr.dtype.element_ty, RTNE),
                 mask=mask)


def gelu_bias_triton(x: torch.Tensor, bias: Optional[torch.Tensor],
                     approximate: str) -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is not None and (bias.dim() > 1 or bias.numel() not in (1, x.shape[-1])):
        return gelu_bias_reference(x, bias, approximate)  # not a per-channel bias: broadcast
    shape, n_cols = x.shape, x.shape[-1]
    x2 = rows(x)
    out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    b = vector(bias.expand(n_cols), n_cols) if bias is not None else x2
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows and n_cols:
        block_rows, block_n, num_warps, launch = tiles("gelu_bias", n_rows, n_cols)
        _gelu_bias_kernel[launch](x2, b, out, n_rows, n_cols, x2.stride(0), HAS_BIAS=bias is not None,
                                  TANH=approximate == "tanh", BLOCK_ROWS=block_rows, BLOCK_N=block_n,
                                  RTNE=interpreting(), num_warps=num_warps)
    return out.view(shape)


gelu_bias = kernel_op("gelu_bias", gelu_bias_reference,
                      cuda=gelu_bias_triton if triton is not None else None)
