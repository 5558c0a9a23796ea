"""The K/V cache of the decoding engine: `BatchKVCache`, 2 * layers tensors [rows, kv heads,
slots, head dim] written in place by each step at the slots it is given, whose rows join and
leave at every step (continuous batching), with per-row pads and holes masked.

All rows share the slot index (`cache_position`). Slots at or past `length` hold garbage
that causality masks, so dropping a rejected draft's slots is just not advancing past them. A
`CachePool` keeps the tensors from one generation to the next, so that CUDA graphs of its
steps (which read the cache where it is) replay in the next one (artifact/cache_pool.py).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from rbcompile.artifact.cache_pool import CachePool, zeros
from rbcompile.artifact.decoder import DecoderShape


def copy_blocks(tensors: list[torch.Tensor], row: int, start: int,
                blocks: list[list[torch.Tensor]]) -> int:
    """Copy K/V blocks (per cache tensor [kv heads, block, head dim]) one after another into
    row `row` of `tensors` ([rows, kv heads, slots, head dim] each) from slot `start`; returns
    the slot after the last."""
    for block in blocks:
        width = block[0].shape[1]
        for tensor, part in zip(tensors, block, strict=True):
            tensor[row, :, start:start + width].copy_(part)
        start += width
    return start


def power_of_two_at_least(n: int) -> int:
    """The bucket of `n` (a batch, a length): the next power of two, so that CUDA graphs are
    one per bucket rather than one per value."""
    return 1 << (n - 1).bit_length()


def step_inputs(pads: torch.Tensor, start: int, count: int, slots: int) -> tuple:
    """(attention_mask [B, slots], position_ids [B, count], cache_position [count]) of a step
    writing `count` tokens from slot `start` into a cache of `slots` slots whose rows are
    left-padded by `pads` (a prefill from slot 0, then decode steps; pad slots get position
    0, like HF): for tracing and one-step measurements, outside the engine."""
    device = pads.device
    slot_ids = torch.arange(slots, device=device)
    cache_position = slot_ids[start:start + count]
    positions = (cache_position[None] - pads[:, None]).clamp_min(0)
    return (slot_ids[None] >= pads[:, None]).long(), positions, cache_position


class BatchKVCache:
    """K/V for a batch whose rows change at every step (continuous batching).

    `rows` rows are allocated; the first `active` are in use and all share the slot index:
    slot `length` is the next one written. A request joins by a prefill written straight into
    row `active` at slots [length - P, length), so its left pad is `length - P` (slots before it
    are masked; positions are slot - pad), or as a copy of a row that
    joined (`fork`). A row leaves by the last active row being copied into its place. A step
    may write several slots per row (a pending token and drafts); the slots of drafts a row
    rejected become holes, masked for good, and its positions skip them (`advance_rows`). The
    slot axis grows in `block`s when full, after first trying to compact it: moving every row's
    slots left by the smallest pad changes no attention score (positions travel with the keys,
    masks with the pads and holes). The attention mask is kept, not rebuilt per step: each
    active row's is 0 before its pad and on its holes, 1 elsewhere (slots past `length`
    included), an idle row's 1 everywhere (finite attention over its own garbage). With
    `power_of_two` (CUDA graphs, keyed by the capacity and holding the tensors they read) it
    grows to the next power of two of blocks: a step's graphs are one per doubling. The tensors
    it grew out of go to `on_drop` (the decoder's `forget_cache`: the graphs that read them go
    too), or with a `pool` (CUDA graphs across generations) go back to it, and its tensors come
    from it. `slots`: arange over the slot axis (a step's slot and position ids are slices of
    it, no new tensor)."""

    def __init__(self, shape: DecoderShape, rows: int, block: int = 64, power_of_two: bool = False,
                 on_drop: Callable[[list[torch.Tensor]], None] | None = None,
                 pool: CachePool | None = None):
        self.shape, self.rows, self.block, self.power_of_two = shape, rows, block, power_of_two
        self.on_drop, self.pool = on_drop, pool
        self.tensors = self._allocate(block)
        self._views: tuple = (None, None, None)   # (rows, tensors, their views): see `views`
        self.pads = torch.zeros(rows, dtype=torch.long, device=shape.device)
        self.mask = torch.ones(rows, block, dtype=torch.long, device=shape.device)
        self.slots = torch.arange(block, device=shape.device)
        self.skipped = torch.zeros(rows, dtype=torch.long, device=shape.device)   # holes per row
        self.active = self.length = 0

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def _allocate(self, capacity: int) -> list[torch.Tensor]:
        s = self.shape
        take = zeros if self.pool is None else self.pool.take
        return take(2 * s.layers, (self.rows, s.kv_heads, capacity, s.head_dim), s.dtype, s.device)

    def views(self, rows: slice) -> list[torch.Tensor]:
        """The cache tensors of `rows` (views: a step writes into the batch's storage). The
        same view objects while the rows and the tensors are the same: a step's CUDA graph
        knows its in-place inputs again by identity (cuda_graphs.GraphCache)."""
        if self._views[0] != rows or self._views[1] is not self.tensors:
            self._views = rows, self.tensors, [tensor[rows] for tensor in self.tensors]
        return self._views[2]

    def attention_mask(self, rows: slice) -> torch.Tensor:
        """[rows, capacity]: 1 on each row's slots from its pad on, but its holes (a view of
        the kept mask: no op per step)."""
        return self.mask[rows]

    def positions(self, rows: slice) -> torch.Tensor:
        """[rows]: each row's position at slot `length`."""
        return self.length - self.pads[rows] - self.skipped[rows]

    def place(self, prompt_tokens: int) -> int:
        """Room for a `prompt_tokens` prefill ending at slot `length` in row `active`; returns
        that row (the caller writes the prefill there, then calls `join`)."""
        if self.active == self.rows:
            raise ValueError(f"all {self.rows} rows are in use")
        if self.active == 0:
            self.length = 0
        if prompt_tokens > self.length:  # move the running rows right to make room before them
            self._shift(prompt_tokens - self.length)
        self._grow(self.length + 1)   # not `_reserve`: compacting would undo the shift
        pad = self.length - prompt_tokens
        self.pads[self.active] = pad
        self.mask[self.active] = self.slots >= pad
        self.skipped[self.active] = 0
        return self.active

    def write_prompt(self, row: int, blocks: list[list[torch.Tensor]]) -> None:
        """Copy K/V blocks (per cache tensor [kv heads, block, head dim]) into row `row`'s first
        prompt slots, from its pad on (after `place`)."""
        copy_blocks(self.tensors, row, int(self.pads[row]), blocks)

    def prompt_kv(self, row: int, tokens: int) -> list[torch.Tensor]:
        """Views of row `row`'s first `tokens` prompt slots ([kv heads, tokens, head dim] each)."""
        start = int(self.pads[row])
        return [tensor[row, :, start:start + tokens] for tensor in self.tensors]

    def join(self) -> None:
        """Row `active` (filled by a prefill after `place`) joins the batch."""
        self.active += 1

    def fork(self, row: int) -> int:
        """Row `active` becomes a copy of active row `row` (its pad and its slots up to
        `length`) and joins the batch; returns it. Samples of one prompt share its prefill so."""
        if self.active == self.rows:
            raise ValueError(f"all {self.rows} rows are in use")
        copy, start = self.active, int(self.pads[row])
        for tensor in self.tensors:
            tensor[copy, :, start:self.length].copy_(tensor[row, :, start:self.length])
        self._copy_row(copy, row)
        self.active += 1
        return copy

    def _copy_row(self, to: int, row: int) -> None:
        self.pads[to], self.skipped[to] = self.pads[row], self.skipped[row]
        self.mask[to] = self.mask[row]

    def leave(self, row: int) -> None:
        """Row `row` leaves; the last active row takes its place."""
        last = self.active - 1
        if row != last:
            for tensor in self.tensors:
                tensor[row].copy_(tensor[last])
            self._copy_row(row, last)
        self.mask[last] = 1   # idle
        self.active = last

    def reserve_step(self, tokens: int = 1) -> None:
        """Room for the next `tokens` slots of every active row."""
        self._reserve(self.length + tokens)

    def advance_rows(self, kept: list[int], width: int) -> None:
        """After a step that wrote `width` slots per active row from `length` (a pending token
        and drafts): row i keeps its pending token and `kept[i]` drafts. The batch advances past
        the most kept (the slots after those are written again by the next step); the slots of
        drafts a row rejected before that become holes."""
        most = max(kept, default=width - 1)
        for row, count in enumerate(kept):
            if count < most:
                self.mask[row, self.length + count + 1:self.length + most + 1] = 0
                self.skipped[row] += most - count
        self.length += most + 1

    def step_rows(self, buckets: bool) -> int:
        """Rows a decode step runs: the active ones, or with `buckets` their batch bucket."""
        return min(power_of_two_at_least(self.active), self.rows) if buckets else self.active

    def step_inputs(self, ids: list[list[int]], offset: int, buckets: bool, device) -> tuple:
        """A decode step's inputs for `ids` [active rows][width] written `offset` slots past
        `length` (with `buckets`, a batch bucket's idle rows run zeros)."""
        rows, active = slice(0, self.step_rows(buckets)), self.active
        width = len(ids[0])
        ids = ids + [[0] * width] * (rows.stop - active)
        positions = self.positions(rows)
        if rows.stop > active:  # idle rows: finite positions (their mask is all ones)
            positions[active:] = 0
        offsets = self.slots[:width]
        start = self.length + offset
        return (torch.tensor(ids, device=device), self.attention_mask(rows),
                positions[:, None] + offsets + offset, self.slots[start:start + width],
                offsets, self.views(rows))

    def _reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        low = int(self.pads[:self.active].min()) if self.active else 0
        if low >= self.block:  # compacting frees at least a block
            self._shift(-low)
        self._grow(slots)

    def _shift(self, by: int) -> None:
        """Move the active rows' slots by `by` (right if positive), pads and length with them."""
        self._grow(self.length + by)
        start, end = max(0, -by), self.length
        for tensor, axis in [(tensor, 2) for tensor in self.tensors] + [(self.mask, 1)]:
            rows = tensor[:self.active]
            moved = rows.narrow(axis, start, end - start).clone()
            rows.narrow(axis, start + by, end - start).copy_(moved)
        self.pads[:self.active] += by
        self.length += by
        self.mask[:self.active] *= self.slots >= self.pads[:self.active, None]
        self.mask[:, self.length:] = 1    # slots past the length are written afresh

    def _grow(self, slots: int) -> None:
        """At least `slots` slots, in whole blocks (a power of two of them with `power_of_two`)."""
        if slots <= self.capacity:
            return
        blocks = -(-slots // self.block)
        grown = self._allocate(self.block * (power_of_two_at_least(blocks) if self.power_of_two else blocks))
        for new, old in zip(grown, self.tensors):
            new[:, :, :self.capacity].copy_(old)
        mask = self.mask.new_ones(self.rows, grown[0].shape[2])
        mask[:, :self.capacity] = self.mask
        old, self.tensors, self.mask = self.tensors, grown, mask
        self.slots = torch.arange(self.capacity, device=self.slots.device)
        self._views = (None, None, None)
        self.drop(old)

    def emptied(self) -> "BatchKVCache":
        """An empty cache of one block, like this one, in its place (its tensors dropped)."""
        self.drop(self.tensors)
        return BatchKVCache(self.shape, self.rows, self.block, power_of_two=self.power_of_two,
                            on_drop=self.on_drop, pool=self.pool)

    def drop(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` (this cache's, before it grew or was replaced) will not be used again
        (with a pool: by this cache)."""
        if self.pool is not None:
            self.pool.give_back(tensors)
        elif self.on_drop is not None:
            self.on_drop(tensors)


def release_freed_memory() -> None:
    """Hand memory freed by the process back to the system where the C library keeps it
    (glibc holds freed large blocks in its heap: a dropped cache would stay in RSS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
