"""A static KV cache for decoder steps (gpt-fast style): 2 * layers tensors allocated once at
their full length, written in place by the step at the slots it is given.

All rows share the slot index (`cache_position`): a batch of prompts of different lengths is
left-padded, and each row's pad slots stay masked (attention mask 0) for the whole request.
Slots at or past `length` hold garbage that causality masks, so dropping uncommitted slots
(a rejected draft) is just not advancing `length`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderShape:
    """What a generation loop needs to know about a decoder: the KV cache's shape, its dtype
    and device, and the position limit."""
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"

    @classmethod
    def from_config(cls, config, dtype=torch.float32, device="cpu") -> "DecoderShape":
        """From a transformers config, through the architecture registry."""
        from .architectures import lookup

        dims = lookup(config).dimensions(config)
        return cls(dims.layers, dims.kv_heads, dims.head_dim, dims.max_positions, dtype, device)

    def sizes(self) -> dict:
        """The integer fields (what a manifest stores)."""
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "max_positions": self.max_positions}


class StaticKVCache:
    """K/V tensors [batch, kv_heads, max_len, head_dim] (k0, v0, k1, v1, ...), the committed
    length, and each row's number of left-pad slots (`pads`)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int,
                 pads: torch.Tensor, dtype=torch.float32, device="cpu"):
        batch = pads.shape[0]
        self.tensors = [torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
                        for _ in range(2 * layers)]
        self.pads = pads.to(device=device, dtype=torch.long)
        self.attention_mask = (torch.arange(max_len, device=device)[None] >= self.pads[:, None]).long()
        self.length = 0

    @property
    def batch(self) -> int:
        return self.pads.shape[0]

    @property
    def max_len(self) -> int:
        return self.attention_mask.shape[1]

    def inputs(self, tokens: int, offset: int = 0):
        """(attention_mask [B, max_len], position_ids [B, T], cache_position [T]) for `tokens`
        tokens written from slot `length + offset` on; pad slots get position 0, like HF."""
        start = self.length + offset
        if start + tokens > self.max_len:
            raise ValueError(f"slots {start}..{start + tokens - 1} past the cache's {self.max_len}")
        cache_position = torch.arange(start, start + tokens, device=self.pads.device)
        position_ids = (cache_position[None] - self.pads[:, None]).clamp_min(0)
        return self.attention_mask, position_ids, cache_position

    def commit(self, tokens: int) -> None:
        """The next `tokens` slots now hold K/V of accepted tokens."""
        if self.length + tokens > self.max_len:
            raise ValueError(f"committing {tokens} slots past the cache's {self.max_len}")
        self.length += tokens

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (finished rows leave the batch)."""
        rows = rows.to(self.pads.device)
        self.tensors = [t.index_select(0, rows) for t in self.tensors]
        self.pads = self.pads.index_select(0, rows)
        self.attention_mask = self.attention_mask.index_select(0, rows)
