"""A decode step's q and k rotated, and k and v written into the static K/V cache, in one op.

Reference: `rotary_pair` (q's and k's rotary embedding) followed by `write_kv` (the rotated k
and v into their cache slots), what a KV-cached decoder layer runs between its projections and
attention once `fuse_kernels` has paired them: two launches per layer; fused, one (vLLM's
rotary + `reshape_and_cache` in one kernel). The rotated k is never materialised: attention
reads it from the cache. The op changes its two cache arguments in place and returns the
rotated q (`mutates_args`, as `write_kv`).

Triton (`rotary_write_kv_triton`, the CUDA implementation): three rows of tiles in one grid:
q's tiles rotate into a new q (`rotary`'s tile body, `rotate_tile`), k's rotate into key cache
slots `cache_position[token]`, v's copy into the value cache's (`write_kv`'s tile body,
`copy_tile_to_slots`, on tiles twice as wide: one program count for all three). Where
`rotary_pair` or `write_kv` would take the reference (see their conditions; the rotated k must
have the key cache's dtype), this takes both references.
"""
import torch

from rbcompile.kernels._triton import interpreting, tl, triton
from rbcompile.kernels.registry import kernel_op
from rbcompile.kernels.rotary import pair_applies, pair_launch, rotary_pair_reference, rotated_like
from rbcompile.kernels.write_kv import write_kv_reference, writes_apply


def rotary_write_kv_reference(key_cache: torch.Tensor, value_cache: torch.Tensor,
                              cache_position: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q_rotated, k_rotated = rotary_pair_reference(q, k, cos, sin)
    write_kv_reference(key_cache, value_cache, cache_position, k_rotated, v)
    return q_rotated


if triton is not None:
    from rbcompile.kernels.rotary import rotate_tile
    from rbcompile.kernels.write_kv import copy_tile_to_slots

    @triton.jit(do_not_specialize=["q_rows", "kv_rows", "q_heads", "kv_heads", "tokens"])
    def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr,
                                pos_ptr, q_rows, kv_rows, half, q_heads, kv_heads, tokens,
                                q_b, q_h, q_t, q_d, k_b, k_h, k_t, k_d, v_b, v_h, v_t, v_d,
                                c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d, qo_b, qo_h, qo_t, qo_d,
                                kc_b, kc_h, kc_s, kc_d, vc_b, vc_h, vc_s, vc_d,
                                BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                RTNE: tl.constexpr):
        """Grid row 0: q's tiles; row 1: k's into key cache slots; row 2: v's into value cache
        slots (tiles of whole head rows, BLOCK_N half of one)."""
        which = tl.program_id(1)
        if which == 0:
            rotate_tile(q_ptr, cos_ptr, sin_ptr, qo_ptr, pos_ptr, q_rows, half, q_heads, tokens,
                        q_b, q_h, q_t, q_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                        qo_b, qo_h, qo_t, qo_d, BLOCK_ROWS, BLOCK_N, RTNE, False)
        elif which == 1:
            rotate_tile(k_ptr, cos_ptr, sin_ptr, kc_ptr, pos_ptr, kv_rows, half, kv_heads, tokens,
                        k_b, k_h, k_t, k_d, c_b, c_h, c_t, c_d, s_b, s_h, s_t, s_d,
                        kc_b, kc_h, kc_s, kc_d, BLOCK_ROWS, BLOCK_N, RTNE, True)
        else:
            copy_tile_to_slots(v_ptr, vc_ptr, pos_ptr, kv_rows, 2 * half, kv_heads, tokens,
                               v_b, v_h, v_t, v_d, vc_b, vc_h, vc_s, vc_d, BLOCK_ROWS, 2 * BLOCK_N)


def rotary_write_kv_triton(key_cache: torch.Tensor, value_cache: torch.Tensor,
                           cache_position: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    k_dtype = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
    if not (pair_applies(q, k, cos, sin)
            and writes_apply(key_cache, value_cache, cache_position, k, v, k_dtype)):
        return rotary_write_kv_reference(key_cache, value_cache, cache_position, q, k, v, cos, sin)
    cos, sin = cos.expand(q.shape), sin.expand(q.shape)  # the same strides as over k's heads
    q_out = rotated_like(q, cos, sin)
    launch = pair_launch(q, k, 3)
    if launch is not None:
        rows, (block_rows, block_n, num_warps, grid) = launch
        _rotary_write_kv_kernel[grid](
            q, k, v, cos, sin, q_out, key_cache, value_cache, cache_position, *rows,
            *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *q_out.stride(),
            *key_cache.stride(), *value_cache.stride(), BLOCK_ROWS=block_rows, BLOCK_N=block_n,
            RTNE=interpreting(), num_warps=num_warps)
    return q_out


rotary_write_kv = kernel_op("rotary_write_kv", rotary_write_kv_reference,
                            cuda=rotary_write_kv_triton if triton is not None else None,
                            mutates_args=("key_cache", "value_cache"))
