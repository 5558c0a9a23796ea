"""RMSNorm, and residual add + RMSNorm (returns the normalised output and the new residual).

Reference: transformers' LlamaRMSNorm (models/llama/modeling_llama.py): normalise in fp32,
cast back to the input dtype, then scale by the weight.

Triton (`rms_norm_triton`, `add_rms_norm_triton`, the CUDA implementations): one program per
block of rows, each row reduced in fp32 inside the program, the same numerics (the residual sum
is rounded to its dtype before it is normalised, as the reference's `residual + x` is).
"""
from typing import Optional

import torch

from rbcompile.kernels._triton import cast, interpreting, norm_buffers, tl, triton, vector
from rbcompile.kernels.configs import blocks
from rbcompile.kernels.registry import kernel_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = residual + x
    return rms_norm_reference(total, weight, eps), total


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, total_ptr, n_rows, n_cols, x_stride,
                         r_stride, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, RTNE: tl.constexpr):
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, BLOCK_N)
        mask = (row[:, None] < n_rows) & (col[None, :] < n_cols)
        row64 = row.to(tl.int64)[:, None]
        x = tl.load(x_ptr + row64 * x_stride + col[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row64 * r_stride + col[None, :], mask=mask, other=0.0)
            x = cast(r.to(tl.float32) + x.to(tl.float32), total_ptr.dtype.element_ty, RTNE)
            tl.store(total_ptr + row64 * n_cols + col[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        mean_square = tl.sum(xf * xf, axis=1) / n_cols
        normed = cast(xf * tl.rsqrt(mean_square + eps)[:, None], x.dtype, RTNE)  # HF: cast, then weight
        w = tl.load(w_ptr + col, mask=col < n_cols, other=0.0).to(tl.float32)
        y = w[None, :] * normed.to(tl.float32)
        tl.store(out_ptr + row64 * n_cols + col[None, :], cast(y, out_ptr.dtype.element_ty, RTNE),
                 mask=mask)


def _rms_norm_launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    x2, r2, out, total, shape = norm_buffers(x, residual, weight.dtype)
    n_rows, n_cols = x2.shape
    w = vector(weight, n_cols)
    if n_rows and n_cols:
        kernel = "rms_norm" if residual is None else "add_rms_norm"
        block_rows, block_n, num_warps, launch = blocks(kernel, n_rows, n_cols)
        _rms_norm_kernel[launch](
            x2, r2, w, out, total, n_rows, n_cols, x2.stride(0), r2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            RTNE=interpreting(), num_warps=num_warps)
    return out.view(shape), (total.view(shape) if residual is not None else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_launch(x, residual, weight, eps)


_cuda = triton is not None
rms_norm = kernel_op("rms_norm", rms_norm_reference, cuda=rms_norm_triton if _cuda else None)
add_rms_norm = kernel_op("add_rms_norm", add_rms_norm_reference,
                         cuda=add_rms_norm_triton if _cuda else None)
