"""A step's new keys and values written into the static K/V cache in one op.

Reference: the two `index_copy_` a transformers StaticCache layer makes per step
(`key_cache.index_copy_(2, cache_position, k)`, the same for the values): two launches per
layer; fused, one. The op changes its two cache arguments in place and returns nothing
(`mutates_args`: torch.export, inductor and CUDA graph capture order the reads after it).

Triton (`write_kv_triton`, the CUDA implementation): k / v `[batch, kv heads, tokens, head_dim]`
with any strides (the transposed projection, the rotary's output), the caches `[batch, kv heads,
slots, head_dim]`; one program per tile of rows (batch x heads x tokens) x head dimension copies
k's and v's tile to slot `cache_position[token]`. Other ranks or shapes, k / v of a dtype
other than their cache's, other devices, or positions that are not 1-D integers take the
reference.
"""
import torch

from ._triton import tile_offsets, tl, triton
from .configs import tiles
from .registry import kernel_op


def write_kv_reference(key_cache: torch.Tensor, value_cache: torch.Tensor,
                       cache_position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    key_cache.index_copy_(2, cache_position, k)
    value_cache.index_copy_(2, cache_position, v)


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows", "heads", "tokens"])
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, n_rows, width, heads, tokens,
                         k_b, k_h, k_t, k_d, v_b, v_h, v_t, v_d,
                         kc_b, kc_h, kc_s, kc_d, vc_b, vc_h, vc_s, vc_d,
                         BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        row, col, mask = tile_offsets(n_rows, width, BLOCK_ROWS, BLOCK_N)
        row64 = row.to(tl.int64)
        t = row64 % tokens
        h = (row64 // tokens) % heads
        b = row64 // tokens // heads
        slot = tl.load(pos_ptr + t, mask=row < n_rows, other=0).to(tl.int64)
        d = col.to(tl.int64)[None, :]
        k = tl.load(k_ptr + (b * k_b + h * k_h + t * k_t)[:, None] + d * k_d, mask=mask)
        v = tl.load(v_ptr + (b * v_b + h * v_h + t * v_t)[:, None] + d * v_d, mask=mask)
        tl.store(kc_ptr + (b * kc_b + h * kc_h + slot * kc_s)[:, None] + d * kc_d, k, mask=mask)
        tl.store(vc_ptr + (b * vc_b + h * vc_h + slot * vc_s)[:, None] + d * vc_d, v, mask=mask)


_POSITIONS = (torch.int64, torch.int32)


def write_kv_triton(key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cache_position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if (k.dim() != 4 or k.shape != v.shape or key_cache.shape != value_cache.shape
            or key_cache.dim() != 4 or key_cache.shape[:2] + key_cache.shape[3:]
            != k.shape[:2] + k.shape[3:] or cache_position.shape != (k.shape[2],)
            or cache_position.dtype not in _POSITIONS or k.dtype != key_cache.dtype
            or v.dtype != value_cache.dtype
            or any(t.device != k.device for t in (v, key_cache, value_cache, cache_position))):
        return write_kv_reference(key_cache, value_cache, cache_position, k, v)
    batch, heads, tokens, width = k.shape
    n_rows = batch * heads * tokens
    if n_rows and width:
        block_rows, block_n, num_warps, launch = tiles("write_kv", n_rows, width)
        _write_kv_kernel[launch](k, v, key_cache, value_cache, cache_position, n_rows, width,
                                 heads, tokens, *k.stride(), *v.stride(), *key_cache.stride(),
                                 *value_cache.stride(), BLOCK_ROWS=block_rows, BLOCK_N=block_n,
                                 num_warps=num_warps)


write_kv = kernel_op("write_kv", write_kv_reference,
                     cuda=write_kv_triton if triton is not None else None,
                     mutates_args=("key_cache", "value_cache"))
