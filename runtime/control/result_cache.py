"""Exact-repeat result cache: a request whose model fingerprint, plan and token ids match a recent
one gets that request's outputs back without running the model.

Entries are CPU copies kept in LRU order under a byte budget. Each carries a blake2b checksum of
its tensors (names, dtypes, shapes and bytes), checked on every hit: a mismatch drops the entry
and `get` answers None, so the caller recomputes and corrupted data is never served.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

DIGEST_SIZE = 32


def _update(digest, field) -> None:
    """Length-prefixed, so that no two different field sequences hash the same stream."""
    field = memoryview(field)
    digest.update(field.nbytes.to_bytes(8, "little"))
    digest.update(field)


def _update_tensor(digest, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    _update(digest, str(tensor.dtype).encode())
    _update(digest, repr(tuple(tensor.shape)).encode())
    _update(digest, tensor.reshape(-1).view(torch.uint8).numpy())


def checksum(outputs: dict[str, torch.Tensor]) -> bytes:
    """blake2b over every tensor's name, dtype, shape and bytes, in dict order."""
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for name, tensor in outputs.items():
        _update(digest, name.encode())
        _update_tensor(digest, tensor)
    return digest.digest()


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU copy that shares no memory with `tensor` (one copy, any device)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())


@dataclass
class _Entry:
    outputs: dict[str, torch.Tensor]
    checksum: bytes
    nbytes: int


def fingerprint(compiled) -> str:
    """What a cached result of `compiled` depends on: the sha256 of the artifact's files (graph
    and weights), else of its source checkpoint."""
    listed = compiled.manifest.get("files", {}).get("sha256")
    if listed:
        return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()
    return compiled.manifest["source"]["sha256"]


class ResultCache:
    """Thread-safe LRU map key -> per-request outputs, bounded by `max_bytes` of tensor data."""

    def __init__(self, max_bytes: int = 256 << 20):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.budget = max_bytes  # working budget: lowered by `shrink`, reset by `restore`
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._nbytes = 0
        self._stats = dict(hits=0, misses=0, corrupt=0, evictions=0, puts=0)
        self._lock = threading.Lock()

    @staticmethod
    def key(fingerprint: str, plan: str, input_ids: torch.Tensor) -> bytes:
        """blake2b of the model fingerprint, the plan key and the token ids (dtype and shape too)."""
        digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
        _update(digest, fingerprint.encode())
        _update(digest, plan.encode())
        _update_tensor(digest, input_ids)
        return digest.digest()

    def get(self, key: bytes) -> dict[str, torch.Tensor] | None:
        """Copies of the stored outputs, or None on a miss or when the entry fails its checksum
        (it is then dropped and counted in `stats["corrupt"]`)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats["misses"] += 1
                return None
            self._entries.move_to_end(key)
        # Copy and verify outside the lock (both release the GIL on large tensors). The copies
        # are what is checked, so what is returned is exactly what passed.
        outputs = {name: tensor.clone() for name, tensor in entry.outputs.items()}
        intact = checksum(outputs) == entry.checksum
        with self._lock:
            if intact:
                self._stats["hits"] += 1
                return outputs
            self._stats["corrupt"] += 1
            if self._entries.get(key) is entry:
                self._remove(key)
            return None

    def put(self, key: bytes, outputs: dict[str, torch.Tensor]) -> bool:
        """Store CPU copies of `outputs`; False when they alone exceed the working budget."""
        copies = {name: _cpu_copy(tensor) for name, tensor in outputs.items()}
        nbytes = sum(t.numel() * t.element_size() for t in copies.values())
        entry = _Entry(copies, checksum(copies), nbytes)
        with self._lock:
            self._stats["puts"] += 1
            if nbytes > self.budget:
                return False
            if key in self._entries:
                self._remove(key)
            self._entries[key] = entry
            self._nbytes += nbytes
            self._evict_to(self.budget)
            return True

    def shrink(self, keep_fraction: float) -> int:
        """Evict LRU entries until at most `keep_fraction` of the current bytes remain, and lower
        the working budget to that (until `restore`). Returns the number of entries evicted."""
        if not 0.0 <= keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in [0, 1], got {keep_fraction!r}")
        with self._lock:
            self.budget = int(keep_fraction * self._nbytes)
            return self._evict_to(self.budget)

    def limit(self, limit_bytes: int) -> int:
        """Lower the working budget to `limit_bytes` (until `restore`), evicting LRU entries
        down to it. Returns the number of entries evicted."""
        with self._lock:
            self.budget = min(self.max_bytes, limit_bytes)
            return self._evict_to(self.budget)

    def restore(self) -> None:
        """Set the working budget back to `max_bytes`."""
        with self._lock:
            self.budget = self.max_bytes

    def clear(self) -> None:
        """Drop every entry (statistics are kept)."""
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        with self._lock:
            return self._nbytes

    @property
    def stats(self) -> dict[str, int]:
        """A copy of the counters: hits, misses, corrupt, evictions, puts."""
        with self._lock:
            return dict(self._stats)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _remove(self, key: bytes) -> None:
        self._nbytes -= self._entries.pop(key).nbytes

    def _evict_to(self, budget: int) -> int:
        evicted = 0
        while self._nbytes > budget:
            self._remove(next(iter(self._entries)))
            evicted += 1
        self._stats["evictions"] += evicted
        return evicted
