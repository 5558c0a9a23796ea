"""A prefix cache for decoder K/V, as vLLM's automatic prefix caching: prompts' leading tokens
in fixed-size blocks, each block's keys and values (every layer) stored under a hash chain.

A block's key hashes its parent block's key and its own tokens, so one key names the whole
prefix up to the block's end; the chain's root hashes the plan the K/V were computed under
(the gates: a light plan's K/V differ from the full path's). K/V depend on token positions,
not on cache slots, so a block serves any row at any slot. Blocks are evicted least recently
used past `capacity_bytes` (or a lower `set_limit` under memory pressure); each carries a CRC-32 of its tensors, checked before reuse (a
block that fails is dropped, and the prompt is prefilled from there).
"""
from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class PrefixBlock:
    tokens: tuple[int, ...]
    tensors: list[torch.Tensor]     # per cache tensor (k0, v0, k1, ...): [kv heads, block, head dim]
    checksum: int
    nbytes: int


@dataclass
class PrefixCacheStats:
    prompt_tokens: int = 0          # tokens of the prompts looked up
    reused_tokens: int = 0          # of those, served from cached blocks
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class PrefixCache:
    block_tokens: int = 16
    capacity_bytes: int = 256 << 20
    blocks: OrderedDict = field(default_factory=OrderedDict)   # key -> PrefixBlock, LRU first
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    nbytes: int = 0
    limit_bytes: int | None = None   # a lower cap for now (memory pressure); None: the capacity

    @property
    def budget_bytes(self) -> int:
        return self.capacity_bytes if self.limit_bytes is None else min(self.limit_bytes, self.capacity_bytes)

    def set_limit(self, limit_bytes: int | None) -> None:
        """Hold at most `limit_bytes` until the limit is lifted (None): a memory watermark's
        lever. Evicts least recently used blocks down to it now."""
        self.limit_bytes = limit_bytes
        self.shrink(self.budget_bytes)

    def keys(self, prompt: list[int], gates) -> list[bytes]:
        """The chain keys of the prompt's whole blocks under `gates` (None: the full path)."""
        key = hashlib.blake2b(repr(None if gates is None else tuple(gates)).encode(),
                              digest_size=16).digest()
        keys = []
        for start in range(0, len(prompt) - self.block_tokens + 1, self.block_tokens):
            block = prompt[start:start + self.block_tokens]
            key = hashlib.blake2b(key + torch.tensor(block, dtype=torch.int64).numpy().tobytes(),
                                  digest_size=16).digest()
            keys.append(key)
        return keys

    def lookup(self, prompt: list[int], gates) -> list[PrefixBlock]:
        """The longest run of cached, intact blocks the prompt starts with, leaving at least one
        prompt token to prefill (its logits give the first new token)."""
        usable = (len(prompt) - 1) // self.block_tokens
        found = []
        for index, key in enumerate(self.keys(prompt, gates)[:usable]):
            block = self.blocks.get(key)
            start = index * self.block_tokens
            if block is None or block.tokens != tuple(prompt[start:start + self.block_tokens]):
                break
            if _checksum(block.tensors) != block.checksum:
                self._drop(key)
                self.stats.corrupt_blocks += 1
                break
            self.blocks.move_to_end(key)
            found.append(block)
        self.stats.prompt_tokens += len(prompt)
        self.stats.reused_tokens += len(found) * self.block_tokens
        return found

    def insert(self, prompt: list[int], gates, tensors: list[torch.Tensor]) -> None:
        """Store the prompt's whole blocks not cached yet; `tensors` hold the prompt's K/V
        ([kv heads, prompt length, head dim] per cache tensor, position 0 first)."""
        for index, key in enumerate(self.keys(prompt, gates)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            start = index * self.block_tokens
            kept = [tensor[:, start:start + self.block_tokens].clone() for tensor in tensors]
            nbytes = sum(t.numel() * t.element_size() for t in kept)
            if nbytes > self.budget_bytes:
                return
            self.blocks[key] = PrefixBlock(tuple(prompt[start:start + self.block_tokens]), kept,
                                           _checksum(kept), nbytes)
            self.nbytes += nbytes
            self.stats.inserted_blocks += 1
            self.shrink(self.budget_bytes)

    def shrink(self, limit_bytes: int) -> None:
        """Evict least recently used blocks until at most `limit_bytes` are held."""
        while self.nbytes > limit_bytes and self.blocks:
            self._drop(next(iter(self.blocks)))
            self.stats.evicted_blocks += 1

    def _drop(self, key: bytes) -> None:
        self.nbytes -= self.blocks.pop(key).nbytes


def _checksum(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc
