"""What the Triton launchers share: the guarded import, rows of a tensor, a tile's offsets.

Triton is optional: where it is missing `triton` / `tl` are None, `AVAILABLE` is False, the
kernel files define no `@triton.jit` functions and register no CUDA implementation (the ops then
run their PyTorch references everywhere). Set `TRITON_INTERPRET=1` before importing this package
to run the kernels on CPU tensors (Triton's interpreter, as the tests do): `triton.jit` reads it
when a kernel is defined.

Layout: every kernel works on rows, `[rows, hidden]` after flattening the leading dimensions;
a norm's program takes a block of `BLOCK_ROWS` rows x the whole (power-of-two padded) hidden
dimension, so it reduces a row inside one program; elementwise kernels take 2-D tiles. Block
sizes and warps: configs.py.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton: references only
    triton = None
    tl = None

AVAILABLE = triton is not None

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, hidden]` with unit column stride (a view where possible, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def vector(v: torch.Tensor, n: int) -> torch.Tensor:
    """A per-hidden-channel parameter (weight / bias) as a contiguous `[n]` vector."""
    if v.numel() != n:
        raise ValueError(f"expected {n} values, got shape {tuple(v.shape)}")
    return v.reshape(n).contiguous()


def norm_buffers(x: torch.Tensor, residual, weight_dtype=None):
    """What a norm launcher (with or without the residual add) passes its kernel: rows of `x`
    and of `residual` (broadcast to one shape; `x`'s rows when None), the output buffer (the
    sum's dtype, promoted with `weight_dtype` when given) and the new-residual buffer (the
    output itself when there is no residual). Returns (x2, r2, out, total, shape)."""
    if residual is not None and residual.shape != x.shape:
        x, residual = torch.broadcast_tensors(x, residual)
    total_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = total_dtype if weight_dtype is None else torch.promote_types(weight_dtype, total_dtype)
    x2 = rows(x)
    r2 = rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    total = torch.empty(x2.shape, dtype=total_dtype, device=x.device) if residual is not None else out
    return x2, r2, out, total, x.shape


if triton is not None:
    @triton.jit
    def cast(y, dtype: tl.constexpr, RTNE: tl.constexpr):
        """`y.to(dtype)`; with RTNE, fp32 -> bf16 rounds to nearest even by integer arithmetic.

        Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), which
        costs up to one bf16 ulp against PyTorch; the launchers set RTNE when interpreting."""
        out = y.to(dtype)
        if RTNE:  # a constexpr: compiled kernels keep the plain cast
            if dtype == tl.bfloat16:
                bits = y.to(tl.float32).to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return out

    @triton.jit
    def tile_offsets(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """An elementwise kernel's tile (grid: configs.tiles): its rows, its columns and their
        mask; a row's column tiles are neighbouring programs."""
        pid = tl.program_id(0)
        col_tiles = tl.cdiv(n_cols, BLOCK_N)
        row = (pid // col_tiles) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        col = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        return row, col, (row[:, None] < n_rows) & (col[None, :] < n_cols)

    @triton.jit
    def head_rows(row, heads, tokens):
        """(batch, head, token) in int64 of rows of a `[batch, heads, tokens, ...]` tensor
        (the head-wide kernels' rows)."""
        row64 = row.to(tl.int64)
        return row64 // tokens // heads, (row64 // tokens) % heads, row64 % tokens
else:
    cast = head_rows = tile_offsets = None
