"""A static KV cache for decoder steps (gpt-fast style): 2 * layers tensors allocated once at
their full length, written in place by the step at the slots it is given.

All rows share the slot index (`cache_position`): a batch of prompts of different lengths is
left-padded, and each row's pad slots stay masked (attention mask 0) for the whole request.
Slots at or past `length` hold garbage that causality masks, so dropping uncommitted slots
(a rejected draft) is just not advancing `length`. A `CachePool` keeps the tensors from one
generation to the next, so that CUDA graphs of its steps (which read the cache where it is)
replay in the next one.
"""
from __future__ import annotations

import ctypes

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .region_cache import tensor_bytes


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


def padded_rows(running: int, rows: int, device) -> torch.Tensor:
    """Row indices [rows]: 0 .. running - 1, then copies of the last (a batch bucket's idle
    rows)."""
    return torch.arange(rows, device=device).clamp_max(running - 1)


def zeros(count: int, shape: tuple, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` (a set of K/V cache tensors)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


class CachePool:
    """K/V tensors kept between generations (gpt-fast allocates its cache once). A CUDA graph
    of a decoder step reads the cache where it is and is keyed by its address, so a generation
    that gets the tensors of the one before replays that one's graphs instead of capturing its
    own. A cache takes a set of tensors of one shape and gives it back when its generation
    ends or its batch moves to a smaller bucket. The sets waiting hold at most `max_share`
    times the bytes of the largest of them, the least recently given back dropped first: two
    sets of one shape, or one batch's buckets (8, 4, 2 and 1 rows: under twice the 8-row
    set's bytes). Lengths are rounded up (`slots`) so that requests of similar length share a
    shape. A set dropped for good (by that bound, by `clear`, or a cache's own set that it
    `discard`s) goes to `on_drop`: the graphs that read it can let it go. Thread-safe."""

    def __init__(self, max_share: float = 2.0, min_slots: int = 64,
                 on_drop: Callable[[list[torch.Tensor]], None] | None = None):
        self.max_share, self.min_slots, self.on_drop = max_share, min_slots, on_drop
        self._waiting: list[tuple[tuple, list[torch.Tensor]]] = []   # oldest first
        self._lock = threading.Lock()
        self.taken = self.reused = 0

    def slots(self, needed: int, limit: int) -> int:
        """The cache length for `needed` slots: the next power of two, at least `min_slots`,
        at most `limit` (the model's positions) unless `needed` is more."""
        return max(needed, min(max(self.min_slots, power_of_two_at_least(needed)), limit))

    def take(self, count: int, shape: tuple, dtype: torch.dtype, device) -> list[torch.Tensor]:
        """`count` zeroed tensors of `shape`: a waiting set when there is one."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors say
        key = (count, tuple(shape), dtype, device)
        with self._lock:
            found = next((i for i, (waiting, _) in enumerate(self._waiting) if waiting == key), None)
            tensors = None if found is None else self._waiting.pop(found)[1]
            self.taken += 1
            self.reused += tensors is not None
        if tensors is None:
            return zeros(count, shape, dtype, device)
        for tensor in tensors:
            tensor.zero_()
        return tensors

    def give_back(self, tensors: list[torch.Tensor]) -> None:
        """`tensors`, a set `take` gave, may be taken again."""
        first, dropped = tensors[0], []
        with self._lock:
            self._waiting.append(((len(tensors), tuple(first.shape), first.dtype, first.device),
                                  tensors))
            sizes = [tensor_bytes(waiting) for _, waiting in self._waiting]
            while sum(sizes) > self.max_share * max(sizes):
                dropped.append(self._waiting.pop(0)[1])
                del sizes[0]
        for waiting in dropped:
            self.discard(waiting)

    def discard(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` will not be used again (a set dropped, or one a cache made itself)."""
        if self.on_drop is not None:
            self.on_drop(tensors)

    def clear(self) -> None:
        with self._lock:
            dropped, self._waiting = [tensors for _, tensors in self._waiting], []
        for waiting in dropped:
            self.discard(waiting)


class StaticKVCache:
    """K/V tensors [batch, kv_heads, slots, head_dim] (k0, v0, k1, v1, ...), the committed
    length, each row's next position, `slots` (arange over the slot axis: a step's slot and
    position ids are slices of it, no new tensor and on a GPU no launch per step), and the
    attention mask [batch, slots]: 0 on each row's left-pad slots and on the slots of drafts
    that row rejected while another row kept them (so rows of one batch keep different numbers
    of drafts without moving any K/V). The slot axis grows in `block`s when a step needs more.

    With a `pool` (CUDA graphs), the batch comes in buckets: its rows are the next power of two
    of the running ones, the rows past those idling as copies of the last running row (the
    caller runs them on copies of its tokens, see `ModelRunner`), and the tensors of each
    bucket come from the pool and go back to it when rows finish and the batch moves to a
    smaller bucket, or at `release`; so a decode step's graph is one per batch bucket. Tensors
    a step grows are the cache's own."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int,
                 pads: torch.Tensor, dtype=torch.float32, device="cpu", block: int = 64,
                 pool: CachePool | None = None):
        self.block, self.pool = block, pool
        pads = pads.to(device=device, dtype=torch.long)
        if pool is not None:
            pads = pads[self._bucket_rows(len(pads), pads.device)]
        shape = (len(pads), kv_heads, max_len, head_dim)
        self.tensors = (pool.take if pool is not None else zeros)(2 * layers, shape, dtype, device)
        self._pooled = pool is not None   # the tensors are the pool's (given back when replaced)
        self.positions = -pads   # each row's position at slot `length` (negative over its pads)
        self.slots = torch.arange(max_len, device=device)  # sliced for slot and position ids
        self.attention_mask = (self.slots[None] >= pads[:, None]).long()
        self.length = 0

    @property
    def batch(self) -> int:
        """Rows, the idle ones included."""
        return self.positions.shape[0]

    @property
    def max_len(self) -> int:
        return self.attention_mask.shape[1]

    def inputs(self, tokens: int, offset: int = 0):
        """(attention_mask [B, slots], position_ids [B, T], cache_position [T]) for `tokens`
        tokens written from slot `length + offset` on; pad slots get position 0, like HF."""
        start = self.length + offset
        self.reserve(start + tokens)
        steps = self.slots[offset:offset + tokens]
        position_ids = (self.positions[:, None] + steps[None]).clamp_min(0)
        return self.attention_mask, position_ids, self.slots[start:start + tokens]

    def commit(self, tokens: int) -> None:
        """The next `tokens` slots of every row now hold K/V of accepted tokens."""
        self.reserve(self.length + tokens)
        self.length += tokens
        self.positions += tokens

    def commit_rows(self, kept: list[int]) -> None:
        """After a verification step (a pending token and drafts written from slot `length`):
        running row i keeps its pending token and `kept[i]` drafts (idle rows: as the last
        running row). The batch advances past the most kept; each row's rejected slots before
        that are masked."""
        kept = kept + kept[-1:] * (self.batch - len(kept))
        most = max(kept)
        for row, count in enumerate(kept):
            if count < most:
                self.attention_mask[row, self.length + count + 1:self.length + most + 1] = 0
        self.length += most + 1
        self.positions += torch.tensor(kept, device=self.positions.device) + 1

    def reserve(self, slots: int) -> None:
        """At least `slots` slots (grown in whole blocks; new slots unmasked)."""
        if slots <= self.max_len:
            return
        extra = -(-(slots - self.max_len) // self.block) * self.block
        self._replace([torch.cat([t, t.new_zeros(*t.shape[:2], extra, t.shape[3])], 2)
                       for t in self.tensors], pooled=False)
        self.attention_mask = torch.cat(
            [self.attention_mask, self.attention_mask.new_ones(self.batch, extra)], 1)
        self.slots = torch.arange(self.max_len, device=self.slots.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only running rows `rows`, in that order (finished rows leave the batch; with a
        pool, the batch shrinks to their bucket)."""
        device = self.positions.device
        index = rows.to(device)[self._bucket_rows(len(rows), device)]
        moved = [t.index_select(0, index) for t in self.tensors]
        if len(index) == self.batch:     # the same bucket: the rows move within the tensors
            for tensor, rows_moved in zip(self.tensors, moved):
                tensor.copy_(rows_moved)
        elif self.pool is not None:      # a smaller bucket: its tensors come from the pool
            tensors = self.pool.take(len(moved), moved[0].shape, moved[0].dtype, moved[0].device)
            for tensor, rows_moved in zip(tensors, moved):
                tensor.copy_(rows_moved)
            self._replace(tensors, pooled=True)
        else:
            self._replace(moved, pooled=False)
        self.positions = self.positions.index_select(0, index)
        self.attention_mask = self.attention_mask.index_select(0, index)

    def release(self) -> None:
        """The generation is over: the pool's tensors (if still in use) go back to it."""
        self._replace([], pooled=False)

    def _bucket_rows(self, running: int, device) -> torch.Tensor:
        """Indices of the batch's rows for `running` running rows: those, then (with a pool)
        copies of the last up to the next power of two."""
        rows = power_of_two_at_least(running) if self.pool is not None else running
        return padded_rows(running, rows, device)

    def _replace(self, tensors: list[torch.Tensor], pooled: bool) -> None:
        """`tensors` (the pool's when `pooled`) replace the ones the cache had: those go back
        to the pool, or, made by the cache itself, are discarded."""
        if self._pooled:
            self.pool.give_back(self.tensors)
        elif self.pool is not None and self.tensors:
            self.pool.discard(self.tensors)
        self.tensors, self._pooled = tensors, pooled


class BatchKVCache:
    """K/V for a batch whose rows change at every step (continuous batching).

    `rows` rows are allocated; the first `active` are in use and all share the slot index:
    slot `length` is the next one written. A request joins by a prefill written straight into
    row `active` at slots [length - P, length), so its left pad is `length - P` (slots before it
    are masked; positions are slot - pad, as in StaticKVCache), or as a copy of a row that
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
    too). `slots`: arange over the slot axis, as in StaticKVCache."""

    def __init__(self, shape: DecoderShape, rows: int, block: int = 64, power_of_two: bool = False,
                 on_drop: Callable[[list[torch.Tensor]], None] | None = None):
        self.shape, self.rows, self.block, self.power_of_two = shape, rows, block, power_of_two
        self.on_drop = on_drop
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
        return zeros(2 * s.layers, (self.rows, s.kv_heads, capacity, s.head_dim), s.dtype, s.device)

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

    def advance(self, tokens: int = 1) -> None:
        self.length += tokens

    def advance_rows(self, kept: list[int], width: int) -> None:
        """After a step that wrote `width` slots per active row from `length` (a pending token
        and drafts): row i keeps its pending token and `kept[i]` drafts, the slots of the
        drafts it rejected become holes."""
        for row, count in enumerate(kept):
            if count + 1 < width:
                self.mask[row, self.length + count + 1:self.length + width] = 0
                self.skipped[row] += width - 1 - count
        self.length += width

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
                            on_drop=self.on_drop)

    def drop(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` (this cache's, before it grew or was replaced) will not be used again."""
        if self.on_drop is not None:
            self.on_drop(tensors)


def release_freed_memory() -> None:
    """Hand memory freed by the process back to the system where the C library keeps it
    (glibc holds freed large blocks in its heap: a dropped cache would stay in RSS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
