"""SwiGLU: `silu(gate) * up` (Llama MLP: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`).

Reference: transformers' LlamaMLP with `hidden_act="silu"`.

Triton (`swiglu_triton`, the CUDA implementation): one fp32 expression per element, one cast
to the output dtype (the reference rounds `silu(gate)` to the input dtype first: up to one ulp
apart in bf16 / fp16).
"""
import torch

from rbcompile.kernels._triton import cast, interpreting, rows, tile_offsets, tl, triton
from rbcompile.kernels.configs import tiles
from rbcompile.kernels.registry import kernel_op


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows"])
    def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n_rows, n_cols, gate_stride, up_stride,
                       BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, RTNE: tl.constexpr):
        row, col, mask = tile_offsets(n_rows, n_cols, BLOCK_ROWS, BLOCK_N)
        row64 = row.to(tl.int64)[:, None]
        g = tl.load(gate_ptr + row64 * gate_stride + col[None, :], mask=mask, other=0.0)
        u = tl.load(up_ptr + row64 * up_stride + col[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        y = g * tl.sigmoid(g) * u.to(tl.float32)
        tl.store(out_ptr + row64 * n_cols + col[None, :], cast(y, out_ptr.dtype.element_ty, RTNE),
                 mask=mask)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        gate, up = torch.broadcast_tensors(gate, up)
    shape, n_cols = gate.shape, gate.shape[-1]
    g2, u2 = rows(gate), rows(up)
    out = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    n_rows = g2.shape[0]
    if n_rows and n_cols:
        block_rows, block_n, num_warps, launch = tiles("swiglu", n_rows, n_cols)
        _swiglu_kernel[launch](g2, u2, out, n_rows, n_cols, g2.stride(0), u2.stride(0),
                               BLOCK_ROWS=block_rows, BLOCK_N=block_n, RTNE=interpreting(),
                               num_warps=num_warps)
    return out.view(shape)


swiglu = kernel_op("swiglu", swiglu_reference, cuda=swiglu_triton if triton is not None else None)
