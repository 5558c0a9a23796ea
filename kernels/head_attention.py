"""Attention over the first `heads` (importance-sorted) heads: scaled_dot_product_attention on
views of q / k / v, never a copy of the projections' weights or activations.

With GQA the key / value heads kept are `heads * kv_heads // q_heads` (whole groups).
Reference: torch.nn.functional.scaled_dot_product_attention as transformers' sdpa attention
calls it.

No Triton kernel: the op is this SDPA wrapper on every device (SDPA already picks fused flash /
memory-efficient kernels on CUDA). The wrapper only narrows: `q.narrow(1, 0, heads)` etc. are
views of the callers' tensors (no copy of q / k / v; tests/test_kernels.py checks the storage).
"""
from typing import Optional

import torch

from .registry import kernel_op


def head_slice_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   mask: Optional[torch.Tensor], heads: int, scale: float,
                                   is_causal: bool) -> torch.Tensor:
    kv_heads = heads * k.shape[1] // q.shape[1]
    if mask is not None and mask.dim() == 4 and mask.shape[1] == q.shape[1] > 1:
        mask = mask.narrow(1, 0, heads)  # a mask per head: keep the kept heads' rows
    return torch.nn.functional.scaled_dot_product_attention(
        q.narrow(1, 0, heads), k.narrow(1, 0, kv_heads), v.narrow(1, 0, kv_heads),
        attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=kv_heads != heads)


head_slice_attention = kernel_op("head_slice_attention", head_slice_attention_reference)
