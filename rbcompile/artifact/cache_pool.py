"""K/V tensors kept between generations, for CUDA graphs of the decoder's steps (the decoder
owns the pool; the engine's cache takes its tensors from it)."""
from __future__ import annotations

import threading
from typing import Callable

import torch

from rbcompile.artifact.region_cache import tensor_bytes


def zeros(count: int, shape: tuple, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """`count` zero tensors of `shape` (a set of K/V cache tensors)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


class CachePool:
    """K/V tensors kept between generations (gpt-fast allocates its cache once). A CUDA graph
    of a decoder step reads the cache where it is and is keyed by its address, so a generation
    that gets the tensors of the one before replays that one's graphs instead of capturing its
    own. A cache takes a set of tensors of one shape and gives it back when it grows or its
    generation ends. The sets waiting hold at most `max_share` times the bytes of the largest
    of them, the least recently given back dropped first. A set dropped for good (by that
    bound, by `clear`, or one a cache made itself and `discard`s) goes to `on_drop`: the graphs
    that read it can let it go. Thread-safe."""

    def __init__(self, max_share: float = 2.0,
                 on_drop: Callable[[list[torch.Tensor]], None] | None = None):
        self.max_share, self.on_drop = max_share, on_drop
        self._waiting: list[tuple[tuple, list[torch.Tensor]]] = []   # oldest first
        self._lock = threading.Lock()
        self.taken = self.reused = 0

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
