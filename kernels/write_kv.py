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

from rbcompile.kernels._triton import head_rows, tile_offsets, tl, triton
from rbcompile.kernels.configs import tiles
from rbcompile.kernels.registry import kernel_op


def write_kv_reference(key_cache: torch.Tensor, value_cache: torch.Tensor,
                       cache_position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    key_cache.index_copy_(2, cache_position, k)
    value_cache.index_copy_(2, cache_position, v)


if triton is not None:
    @triton.jit
    def copy_tile_to_slots(x_ptr, c_ptr, pos_ptr, n_rows, width, heads, tokens,
                           x_b, x_h, x_t, x_d, c_b, c_h, c_s, c_d,
                           BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        """One tile of `x` [batch, heads, tokens, width] copied to the cache's slots
        `pos_ptr[token]`."""
        row, col, mask = tile_offsets(n_rows, width, BLOCK_ROWS, BLOCK_N)
        b, h, t = head_rows(row, heads, tokens)
        slot = tl.load(pos_ptr + t, mask=row < n_rows, other=0).to(tl.int64)
        d = col.to(tl.int64)[None, :]
        x = tl.load(x_ptr + (b * x_b + h * x_h + t * x_t)[:, None] + d * x_d, mask=mask)
        tl.store(c_ptr + (b * c_b + h * c_h + slot * c_s)[:, None] + d * c_d, x, mask=mask)

    @triton.jit(do_not_specialize=["n_rows", "heads", "tokens"])
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, n_rows, width, heads, tokens,
                         k_b, k_h, k_t, k_d, v_b, v_h, v_t, v_d,
                         kc_b, kc_h, kc_s, kc_d, vc_b, vc_h, vc_s, vc_d,
                         BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        copy_tile_to_slots(k_ptr, kc_ptr, pos_ptr, n_rows, width, heads, tokens,
                           k_b, k_h, k_t, k_d, kc_b, kc_h, kc_s, kc_d, BLOCK_ROWS, BLOCK_N)
        copy_tile_to_slots(v_ptr, vc_ptr, pos_ptr, n_rows, width, heads, tokens,
                           v_b, v_h, v_t, v_d, vc_b, vc_h, vc_s, vc_d, BLOCK_ROWS, BLOCK_N)


_POSITIONS = (torch.int64, torch.int32)


def writes_apply(key_cache: torch.Tensor, value_cache: torch.Tensor,
                 cache_position: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel writes k (of `k_dtype`, default k's: what a fused op writes) and v
    into the caches (else the reference runs): 4-D, one shape, the caches' dtypes, one device,
    1-D integer positions, one per token."""
    return (k.dim() == 4 and k.shape == v.shape and key_cache.shape == value_cache.shape
            and key_cache.dim() == 4
            and key_cache.shape[:2] + key_cache.shape[3:] == k.shape[:2] + k.shape[3:]
            and cache_position.shape == (k.shape[2],) and cache_position.dtype in _POSITIONS
            and (k_dtype or k.dtype) == key_cache.dtype and v.dtype == value_cache.dtype
            and all(t.device == k.device for t in (v, key_cache, value_cache, cache_position)))


def write_kv_triton(key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cache_position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not writes_apply(key_cache, value_cache, cache_position, k, v):
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
