"""Gated residual `h + g * f(h)` for guarded branches: `gate` is a scalar or one value per row
([batch]), so rows of one batch can take or skip a branch without leaving the batch.

Reference: the residual add of a pre-LN block, `hidden = residual + branch(hidden)`, scaled.

Triton (`gated_residual_triton`, the CUDA implementation): the gate is cast to `h`'s dtype (as
in the reference), then `h + g * f` in fp32 with one cast: a gate of 0 returns `h` exactly, a
gate of 1 returns `h + f` rounded as the reference's add.
"""
import torch

from rbcompile.kernels._triton import cast, interpreting, rows, tile_offsets, tl, triton
from rbcompile.kernels.configs import tiles
from rbcompile.kernels.registry import kernel_op


def gated_residual_reference(h: torch.Tensor, f: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    g = gate.to(h.dtype)
    if g.dim() == 1:
        g = g.view(-1, *([1] * (h.dim() - 1)))
    return h + g * f


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows", "rows_per_gate"])
    def _gated_residual_kernel(h_ptr, f_ptr, gate_ptr, out_ptr, n_rows, n_cols, h_stride,
                               f_stride, rows_per_gate, BLOCK_ROWS: tl.constexpr,
                               BLOCK_N: tl.constexpr, RTNE: tl.constexpr):
        row, col, mask = tile_offsets(n_rows, n_cols, BLOCK_ROWS, BLOCK_N)
        row64 = row.to(tl.int64)[:, None]
        h = tl.load(h_ptr + row64 * h_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + row64 * f_stride + col[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + row // rows_per_gate, mask=row < n_rows, other=0.0).to(tl.float32)
        y = h + g[:, None] * f
        tl.store(out_ptr + row64 * n_cols + col[None, :], cast(y, out_ptr.dtype.element_ty, RTNE),
                 mask=mask)


def gated_residual_triton(h: torch.Tensor, f: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    per_row = gate.dim() == 1 and gate.numel() > 1
    if (h.shape != f.shape or h.dim() < 1 or gate.dim() > 1
            or (per_row and (h.dim() < 2 or gate.shape[0] != h.shape[0]))):
        return gated_residual_reference(h, f, gate)  # broadcasting beyond rows: the reference
    shape, n_cols = h.shape, h.shape[-1]
    h2, f2 = rows(h), rows(f)
    n_rows = h2.shape[0]
    g = gate.to(device=h.device, dtype=h.dtype).reshape(-1).contiguous()
    out = torch.empty(h2.shape, dtype=torch.promote_types(h.dtype, f.dtype), device=h.device)
    if n_rows and n_cols:
        rows_per_gate = n_rows // gate.shape[0] if per_row else n_rows
        block_rows, block_n, num_warps, launch = tiles("gated_residual", n_rows, n_cols)
        _gated_residual_kernel[launch](h2, f2, g, out, n_rows, n_cols, h2.stride(0), f2.stride(0),
                                       rows_per_gate, BLOCK_ROWS=block_rows, BLOCK_N=block_n,
                                       RTNE=interpreting(), num_warps=num_warps)
    return out.view(shape)


gated_residual = kernel_op("gated_residual", gated_residual_reference,
                           cuda=gated_residual_triton if triton is not None else None)
