"""LayerNorm, and residual add + LayerNorm (post-LN BERT: `LayerNorm(x + residual)`; pre-LN
GPT-2: the add before `ln_2`). Returns the normalised output and the new residual.

Reference: torch.nn.functional.layer_norm over the last dimension, as BertSelfOutput /
GPT2Block call it.

Triton (`layer_norm_triton`, `add_layer_norm_triton`, the CUDA implementations): one program per
block of rows; mean and (biased) variance in fp32 inside the program, affine in fp32, one cast to
the output dtype (the input's, as torch's layer_norm); the residual sum is rounded to its dtype
before it is normalised, as the reference's `x + residual` is.
"""
from typing import Optional

import torch

from rbcompile.kernels._triton import cast, interpreting, norm_buffers, tl, triton, vector
from rbcompile.kernels.configs import blocks
from rbcompile.kernels.registry import kernel_op


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return layer_norm_reference(total, weight, bias, eps), total


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows"])
    def _layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, total_ptr, n_rows, n_cols,
                           x_stride, r_stride, eps, HAS_RESIDUAL: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, RTNE: tl.constexpr):
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = tl.arange(0, BLOCK_N)
        col_mask = col < n_cols
        mask = (row[:, None] < n_rows) & col_mask[None, :]
        row64 = row.to(tl.int64)[:, None]
        x = tl.load(x_ptr + row64 * x_stride + col[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row64 * r_stride + col[None, :], mask=mask, other=0.0)
            x = cast(x.to(tl.float32) + r.to(tl.float32), total_ptr.dtype.element_ty, RTNE)
            tl.store(total_ptr + row64 * n_cols + col[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.sum(xf, axis=1) / n_cols
        centred = tl.where(mask, xf - mean[:, None], 0.0)
        variance = tl.sum(centred * centred, axis=1) / n_cols
        w = tl.load(w_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
        y = centred * tl.rsqrt(variance + eps)[:, None] * w[None, :] + b[None, :]
        tl.store(out_ptr + row64 * n_cols + col[None, :], cast(y, out_ptr.dtype.element_ty, RTNE),
                 mask=mask)


def _layer_norm_launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    x2, r2, out, total, shape = norm_buffers(x, residual)
    n_rows, n_cols = x2.shape
    w, b = vector(weight, n_cols), vector(bias, n_cols)
    if n_rows and n_cols:
        kernel = "layer_norm" if residual is None else "add_layer_norm"
        block_rows, block_n, num_warps, launch = blocks(kernel, n_rows, n_cols)
        _layer_norm_kernel[launch](
            x2, r2, w, b, out, total, n_rows, n_cols, x2.stride(0), r2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            RTNE=interpreting(), num_warps=num_warps)
    return out.view(shape), (total.view(shape) if residual is not None else None)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    return _layer_norm_launch(x, None, weight, bias, eps)[0]


def add_layer_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_norm_launch(x, residual, weight, bias, eps)


_cuda = triton is not None
layer_norm = kernel_op("layer_norm", layer_norm_reference, cuda=layer_norm_triton if _cuda else None)
add_layer_norm = kernel_op("add_layer_norm", add_layer_norm_reference,
                           cuda=add_layer_norm_triton if _cuda else None)
