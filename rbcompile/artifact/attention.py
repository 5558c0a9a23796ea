"""Attention over grouped K/V heads (query heads = group x K/V heads), in the fastest exact
form for each call.

A generated module's attention over grouped heads (passes/gqa_attention.py: SDPA with
`enable_gqa=True`) calls `grouped_attention`, which computes what SDPA computes, in one of
three forms (`FORMS`):
- **folded**: the query heads of one group become queries of their K/V head (`[B, KV*G, Q, D]`
  is `[B, KV, G*Q, D]`) and the mask is shared by the group. No K/V copy, and the fused
  kernels that take a mask run (memory-efficient on CUDA). Only where the call has a mask
  shared by all heads and no causal flag, and where it writes fewer elements than copying K/V
  (`folds`): a decode step always (1 query: the queries fold as a view, and the mask
  broadcasts), a long prefill not (the queries, the output and G copies of the mask would
  move more). transformers >= 5.24 folds a single query the same way in eager mode
  (`pack_gqa`);
- **enable_gqa**: SDPA's own grouped heads (on CPU the fused kernel takes them);
- **copies**: K/V repeated per query head (transformers' `repeat_kv`), then SDPA over as many
  heads. On CUDA the kernel that takes a mask takes no grouped heads, and this runtime does
  not yet choose flash attention's grouped heads for a call without a mask (to be measured:
  benchmarks/bench_gqa.py).

Where each form runs (`form`): CUDA folds where `folds` says, and copies otherwise. CPU folds a
single query in 16-bit floats, where its fused kernel packs K/V per query head and folding is
about 4-9x faster for a decode step (benchmarks/bench_gqa.py); with more queries, or in fp32, it
takes `enable_gqa`, about as fast as folding (within ~10% either way). Any other device takes `enable_gqa`.
"""
from __future__ import annotations

import torch

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_HALF = (torch.float16, torch.bfloat16)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, KV, L, D] -> [B, KV * group, L, D], each K/V head repeated for its group's query
    heads (transformers' `repeat_kv`)."""
    batch, heads, length, dim = x.shape
    return x[:, :, None].expand(batch, heads, group, length, dim).reshape(
        batch, heads * group, length, dim)


def folds(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask,
          is_causal: bool) -> bool:
    """Whether folding this call (4-D query, key and value) is exact and writes fewer elements
    than K/V copies would: a 4-D mask shared by all heads, no causal flag, and the output, the
    queries when they are not contiguous and the mask repeated per group when it has a row per
    query together smaller than the copies."""
    if attn_mask is None or is_causal or attn_mask.dim() != 4 or attn_mask.shape[1] != 1:
        return False
    batch, heads, queries, _ = query.shape
    length = key.shape[-2]
    group = heads // key.shape[1]
    written = batch * heads * queries * value.shape[-1]  # the output, back to its heads
    if queries > 1:
        written += 0 if query.is_contiguous() else query.numel()
        if attn_mask.shape[2] > 1:
            written += attn_mask.shape[0] * group * queries * length
    return written < batch * heads * length * (key.shape[-1] + value.shape[-1])


def _folded(query, key, value, attn_mask, dropout_p, is_causal, scale):
    batch, heads, queries, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if queries > 1 and attn_mask.shape[2] > 1:
        attn_mask = attn_mask.repeat(1, 1, group, 1)  # row g * Q + q is the mask's row q
    out = _SDPA(query.reshape(batch, kv_heads, group * queries, query.shape[-1]), key, value,
                attn_mask, dropout_p, is_causal, scale=scale)
    return out.reshape(batch, heads, queries, value.shape[-1])


def _copies(query, key, value, attn_mask, dropout_p, is_causal, scale):
    group = query.shape[1] // key.shape[1]
    return _SDPA(query, repeat_kv(key, group), repeat_kv(value, group), attn_mask, dropout_p,
                 is_causal, scale=scale)


def _enable_gqa(query, key, value, attn_mask, dropout_p, is_causal, scale):
    return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                 enable_gqa=True)


FORMS = {"folded": _folded, "copies": _copies, "enable_gqa": _enable_gqa}


def form(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask,
         is_causal: bool) -> str:
    """How `grouped_attention` runs this call (4-D query, key and value with fewer K/V heads):
    "folded", "copies" or "enable_gqa" (see the module docstring)."""
    device = query.device.type
    if device == "cuda":
        return "folded" if folds(query, key, value, attn_mask, is_causal) else "copies"
    if (device == "cpu" and query.dtype in _HALF and query.shape[2] == 1
            and folds(query, key, value, attn_mask, is_causal)):
        return "folded"
    return "enable_gqa"


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, *, scale: float | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention(..., enable_gqa=True)`, the same values, in the form
    that suits this call and device (`form`)."""
    if query.dim() != 4:
        return _enable_gqa(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if query.shape[1] == key.shape[1]:   # as many query heads as K/V heads: plain attention
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
    return FORMS[form(query, key, value, attn_mask, is_causal)](
        query, key, value, attn_mask, dropout_p, is_causal, scale)
