"""What the Triton launchers share: the guarded import, rows of a tensor, block sizes.

Triton is optional: where it is missing `triton` / `tl` are None, `AVAILABLE` is False, the
kernel files define no `@triton.jit` functions and register no CUDA implementation (the ops then
run their PyTorch references everywhere). Set `TRITON_INTERPRET=1` before importing this package
to run the kernels on CPU tensors (Triton's interpreter, as the tests do): `triton.jit` reads it
when a kernel is defined.

Layout: every kernel works on rows, `[rows, hidden]` after flattening the leading dimensions;
a norm's program takes a block of `BLOCK_ROWS` rows x the whole (power-of-two padded) hidden
dimension, so it reduces a row inside one program; elementwise kernels take 2-D tiles.
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

MAX_HIDDEN = 65536  # one program holds a whole row (Liger-Kernel's MAX_FUSED_SIZE)


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


def blocks(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps) for `n_rows` x `n_cols`.

    Interpreter: large blocks (each program instance costs milliseconds whatever its size).
    GPU: about 4096 elements per program, whole rows, more warps for wide rows.
    """
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"hidden size {n_cols} > {MAX_HIDDEN}: not supported by the Triton kernels")
    block_n = triton.next_power_of_2(max(n_cols, 1))
    budget = 1 << 17 if interpreting() else 4096
    block_rows = max(1, min(budget // block_n, triton.next_power_of_2(max(n_rows, 1))))
    elements = block_rows * block_n
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    return block_rows, block_n, num_warps


def grid(n_rows: int, block_rows: int) -> tuple[int]:
    return (triton.cdiv(n_rows, block_rows),)


def tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, tuple[int, int]]:
    """(BLOCK_ROWS, BLOCK_N, num_warps, grid) for elementwise kernels: 2-D tiles of rows x
    columns (columns tiled by 1024 on the GPU; whole rows, many of them, when interpreting)."""
    budget = 1 << 17 if interpreting() else 4096
    block_n = min(triton.next_power_of_2(max(n_cols, 1)), MAX_HIDDEN if interpreting() else 1024)
    block_rows = max(1, min(budget // block_n, triton.next_power_of_2(max(n_rows, 1))))
    num_warps = 4 if block_rows * block_n <= 2048 else 8
    return block_rows, block_n, num_warps, (triton.cdiv(n_rows, block_rows),
                                            triton.cdiv(n_cols, block_n))


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
else:
    cast = None
