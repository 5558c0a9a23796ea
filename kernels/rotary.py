"""Rotary position embedding: `x * cos + rotate_half(x) * sin`, `rotate_half(x) = cat(-x2, x1)`
(x1, x2: the halves of the last dimension).

Reference: transformers' `apply_rotary_pos_emb` for one of q / k (Llama, Mistral, Qwen2, Gemma,
and the rotated slice of a partial rotary: GPT-NeoX, Phi). Eager runs it as five kernels (two
muls, neg, cat, add) on a head-transposed view; fused it is one.

Triton (`rotary_triton`, the CUDA implementation): `x` `[batch, heads, tokens, head_dim]` with
any strides (the transposed projection, a partial rotary's slice), `cos` / `sin` broadcast to it
(`[batch or 1, 1, tokens, head_dim]`, read through stride-0 dimensions); one program per tile
of rows (batch x heads x tokens) x half the head dimension computes both halves in fp32 with one
cast (the reference rounds each product in the input dtype: up to one ulp apart in bf16 /
fp16). The output has x's layout (`empty_like`), as the reference's has: the compilers check a
custom op's strides against its fake, the reference. Other ranks, an odd head dimension, other
dtypes or devices, or `cos` / `sin` that widen `x` take the reference.

`rotary_pair(q, k, cos, sin)` rotates q and k with the same tables in one launch (their tiles
on two grid rows; Liger's rope does both alike), where `cos` / `sin` have one head to broadcast
over both; else it takes the reference, `rotary` of each.
"""
import torch

from rbcompile.kernels._triton import cast, head_rows, interpreting, tile_offsets, tl, triton
from rbcompile.kernels.configs import tiles
from rbcompile.kernels.registry import kernel_op


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotary_pair_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)


if triton is not None:
    @triton.jit
    def rotate_tile(x_ptr, cos_ptr, sin_ptr, out_ptr, pos_ptr, n_rows, half, heads, tokens,
                x_b, x_h, x_t, x_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                o_b, o_h, o_t, o_d, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                RTNE: tl.constexpr, SLOTS: tl.constexpr):
        """One tile of `x` rotated into `out`; with SLOTS, token t goes to out's token
        `pos_ptr[t]` (a cache slot), else to token t."""
        row, col, mask = tile_offsets(n_rows, half, BLOCK_ROWS, BLOCK_N)
        b, h, t = head_rows(row, heads, tokens)
        out_t = t
        if SLOTS:
            out_t = tl.load(pos_ptr + t, mask=row < n_rows, other=0).to(tl.int64)
        lo = col.to(tl.int64)[None, :]
        hi = lo + half
        x_row = (b * x_b + h * x_h + t * x_t)[:, None]
        c_row = (b * c_b + h * c_h + t * c_t)[:, None]
        s_row = (b * s_b + h * s_h + t * s_t)[:, None]
        x1 = tl.load(x_ptr + x_row + lo * x_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_row + hi * x_d, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + c_row + lo * c_d, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_row + hi * c_d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + s_row + lo * s_d, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + s_row + hi * s_d, mask=mask, other=0.0).to(tl.float32)
        out = out_ptr + (b * o_b + h * o_h + out_t * o_t)[:, None]
        dtype = out_ptr.dtype.element_ty
        tl.store(out + lo * o_d, cast(x1 * c1 - x2 * s1, dtype, RTNE), mask=mask)
        tl.store(out + hi * o_d, cast(x2 * c2 + x1 * s2, dtype, RTNE), mask=mask)

    @triton.jit(do_not_specialize=["n_rows", "heads", "tokens"])
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, half, heads, tokens,
                       x_b, x_h, x_t, x_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                       o_b, o_h, o_t, o_d, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       RTNE: tl.constexpr):
        rotate_tile(x_ptr, cos_ptr, sin_ptr, out_ptr, x_ptr, n_rows, half, heads, tokens,
                x_b, x_h, x_t, x_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                o_b, o_h, o_t, o_d, BLOCK_ROWS, BLOCK_N, RTNE, False)

    @triton.jit(do_not_specialize=["q_rows", "k_rows", "q_heads", "k_heads", "tokens"])
    def _rotary_pair_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_rows, k_rows,
                            half, q_heads, k_heads, tokens,
                            q_b, q_h, q_t, q_d, k_b, k_h, k_t, k_d, c_b, c_h, c_t, c_d,
                            s_b, s_h, s_t, s_d, qo_b, qo_h, qo_t, qo_d, ko_b, ko_h, ko_t, ko_d,
                            BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, RTNE: tl.constexpr):
        """q's tiles on grid row 0, k's on row 1 (k's past its rows are masked off)."""
        if tl.program_id(1) == 0:
            rotate_tile(q_ptr, cos_ptr, sin_ptr, qo_ptr, q_ptr, q_rows, half, q_heads, tokens,
                    q_b, q_h, q_t, q_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                    qo_b, qo_h, qo_t, qo_d, BLOCK_ROWS, BLOCK_N, RTNE, False)
        else:
            rotate_tile(k_ptr, cos_ptr, sin_ptr, ko_ptr, k_ptr, k_rows, half, k_heads, tokens,
                    k_b, k_h, k_t, k_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                    ko_b, ko_h, ko_t, ko_d, BLOCK_ROWS, BLOCK_N, RTNE, False)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel computes `rotary_reference(x, cos, sin)` (else the reference runs)."""
    return (x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4 and x.shape[-1] % 2 == 0
            and all(t.dtype in _FLOATS and t.device == x.device for t in (x, cos, sin))
            and torch.broadcast_shapes(x.shape, cos.shape, sin.shape) == x.shape)


def rotated_like(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's layout, as the reference's elementwise ops give it (and its fake, which the
    compilers check strides against)."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return torch.empty_like(x, dtype=dtype)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not _applies(x, cos, sin):
        return rotary_reference(x, cos, sin)
    cos, sin = cos.expand(x.shape), sin.expand(x.shape)  # broadcast dimensions: stride 0
    out = rotated_like(x, cos, sin)
    batch, heads, tokens, width = x.shape
    n_rows, half = batch * heads * tokens, width // 2
    if n_rows and half:
        block_rows, block_n, num_warps, launch = tiles("rotary", n_rows, half)
        _rotary_kernel[launch](x, cos, sin, out, n_rows, half, heads, tokens, *x.stride(),
                               *cos.stride(), *sin.stride(), *out.stride(),
                               BLOCK_ROWS=block_rows, BLOCK_N=block_n, RTNE=interpreting(),
                               num_warps=num_warps)
    return out


def pair_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether one launch rotates q and k (else each takes `rotary`'s path): cos / sin
    broadcast over heads (one head) for both, q and k differ only in their heads."""
    return (_applies(q, cos, sin) and _applies(k, cos, sin) and cos.shape[1] == 1
            and sin.shape[1] == 1 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:])


def rotary_pair_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in one launch, where `pair_applies`."""
    if not pair_applies(q, k, cos, sin):
        return rotary_pair_reference(q, k, cos, sin)
    cos, sin = cos.expand(q.shape), sin.expand(q.shape)  # the same strides as over k's heads
    q_out, k_out = rotated_like(q, cos, sin), rotated_like(k, cos, sin)
    launch = pair_launch(q, k, 2)
    if launch is not None:
        rows, (block_rows, block_n, num_warps, grid) = launch
        _rotary_pair_kernel[grid](
            q, k, cos, sin, q_out, k_out, *rows, *q.stride(), *k.stride(), *cos.stride(),
            *sin.stride(), *q_out.stride(), *k_out.stride(), BLOCK_ROWS=block_rows,
            BLOCK_N=block_n, RTNE=interpreting(), num_warps=num_warps)
    return q_out, k_out


def pair_launch(q: torch.Tensor, k: torch.Tensor, grid_rows: int):
    """A launch over q's tiles and k's (and more of k's shape) on `grid_rows` rows of the grid:
    ((q rows, k rows, half, q heads, k heads, tokens), (BLOCK_ROWS, BLOCK_N, num_warps, grid)),
    or None when there is nothing to rotate."""
    batch, q_heads, tokens, width = q.shape
    k_heads, half = k.shape[1], width // 2
    q_rows, k_rows = batch * q_heads * tokens, batch * k_heads * tokens
    if not (q_rows and half):
        return None
    block_rows, block_n, num_warps, (programs,) = tiles("rotary", max(q_rows, k_rows), half)
    return ((q_rows, k_rows, half, q_heads, k_heads, tokens),
            (block_rows, block_n, num_warps, (programs, grid_rows)))


rotary = kernel_op("rotary", rotary_reference, cuda=rotary_triton if triton is not None else None)
rotary_pair = kernel_op("rotary_pair", rotary_pair_reference,
                        cuda=rotary_pair_triton if triton is not None else None)
