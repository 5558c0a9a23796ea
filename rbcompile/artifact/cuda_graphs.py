"""CUDA graphs per plan: one captured graph per (gates, widths, input shapes), replayed.

A gate decision then costs one graph replay: the region interpreter's Python choices (see
rbcompile/artifact/regions.py), the per-region calls and every kernel launch happen once, at capture. `GraphCache` is what the
artifact runtime (`CompiledModel.use_cuda_graphs`) and the torch.compile backend
(`options={"cuda_graphs": True}`) share:

- lazily captured: a key is captured the `capture_after`-th time it is seen (earlier calls run
  eagerly, so a shape seen once, such as a growing dynamic KV cache, never costs a capture);
- bounded: at most `max_graphs` graphs, least recently used evicted first, and `forget(tensors)`
  drops at once the graphs that read tensors their owner is done with (a K/V set);
- memory-aware: when the inputs' device has less than `min_free_fraction` of its memory
  free, or a capture fails for memory, the call runs eagerly and the key is not captured;
- thread-safe: a call holds the cache from its lookup through its replay and copy-out (the
  graph's input buffers are shared), and a capture runs on the device of its inputs;
- keyed by everything a replay cannot change: the caller's key (the plan), each tensor input's
  shape and dtype, and the values of the other inputs (a captured graph holds the Python ints,
  floats and lists it was captured with: dynamo passes a changing int as one);
- static inputs: each tensor input is copied into a buffer of the graph's own before a replay,
  except inputs `in_place(tensor)` accepts (a static KV cache marked with
  `torch._dynamo.mark_static_address`, buffers the caller owns) and inputs at the positions
  `in_place_at` (those the run writes: a copy would take the write), which the graph reads where
  they are; their addresses are part of the key. The inputs at `in_place_at` are put back after
  a capture (whose warm-up runs write them), so a call writes them once (a counter the run
  increments counts one). Outputs are copied out, so a later replay never overwrites what a
  caller holds: only the part a call's `select` picks (its rows of a padded bucket), or none
  with `borrow_outputs` (the graph's own buffers, valid until the cache's next call, as
  inductor's `reduce-overhead` hands out: for callers that are done with an output before they
  call again; graphs share one memory pool, so any replay may overwrite it);
- cheap to repeat: a call whose in-place inputs are the very tensor objects the last replayed
  graph read (a decode step's 2 x layers cache tensors, step after step) is matched to that
  graph by identity and the other inputs' keys, without keying every input again. A tensor
  object keeps its shape, dtype and address unless changed in place (`set_`, `resize_`), which
  an in-place input must not be.

The capture itself is a function `(run, static_inputs) -> (replay, static_outputs)`:
`cuda_capture` on a GPU, a fake one in the CPU tests.
"""
from __future__ import annotations

import logging
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from rbcompile.artifact.regions import Plan
from rbcompile.errors import first_line

logger = logging.getLogger("rbcompile.artifact.cuda_graphs")
_MAX_SEEN = 4096


def cuda_device(inputs) -> torch.device:
    """The CUDA device of the first CUDA tensor among `inputs` (a RuntimeError if none: what
    runs on another device cannot be captured)."""
    device = next((v.device for v in inputs if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if device is None:
        raise RuntimeError("no CUDA tensor among the inputs")
    return device


def cuda_capture(run: Callable, static_inputs: list, pool=None):
    """Warm `run` up on a side stream, capture it into a CUDA graph on the inputs' device,
    return (replay, outputs)."""
    with torch.cuda.device(cuda_device(static_inputs)):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy inits, autotuning, allocator growth: outside the capture
                run(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = run(*static_inputs)
    return graph.replay, outputs


def cuda_free_fraction(inputs) -> float:
    """The share of memory free on the CUDA device of `inputs`."""
    free, total = torch.cuda.mem_get_info(cuda_device(inputs))
    return free / total


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    repeats: int = 0            # of those, found by identity as the last replay's repeat
    eager_calls: int = 0        # calls before capture, or without room to capture
    evictions: int = 0
    released: int = 0           # graphs dropped with the tensors they read in place (`forget`)
    memory_fallbacks: int = 0   # captures skipped or failed for lack of memory
    capture_failures: int = 0   # keys that cannot be captured (they run eagerly from then on)


@dataclass
class _Graph:
    replay: Callable
    inputs: list    # what the graph reads: its own buffers, in-place inputs, scalars
    copied: list    # (position, buffer) of each input a call's value is copied into
    outputs: object


@dataclass
class _LastReplay:
    """The last replayed graph and what identifies a call to it again: its key, the in-place
    inputs (as objects) and the other inputs' keys."""
    key: tuple
    graph: _Graph
    size: int                # number of inputs
    in_place: tuple          # positions of the in-place inputs
    objects: tuple           # the tensors at those positions
    others: tuple            # the other positions
    others_key: tuple        # their keys


def is_static_address(value) -> bool:
    """True for tensors marked with `torch._dynamo.mark_static_address` (HF's StaticCache)."""
    return getattr(value, "_dynamo_static_input_type", None) is not None


def plan_key(gates, widths) -> tuple:
    """The part of a graph's key that names its plan (`Plan.key`)."""
    return Plan(gates, widths).key


def _frozen(value):
    """A hashable stand-in for a non-tensor input (lists and tuples become tuples)."""
    if not isinstance(value, (list, tuple)):
        return value
    value = tuple(value)
    try:
        hash(value)  # flat (a plan's gates): hashed in C, not walked here
        return value
    except TypeError:
        return tuple(_frozen(v) for v in value)


def _clone_outputs(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(_clone_outputs(o) for o in outputs)
    return outputs


class GraphCache:
    """Captured graphs of `run` by key (see the module docstring)."""

    def __init__(self, run: Callable, *, max_graphs: int = 16, capture_after: int = 1,
                 min_free_fraction: float = 0.05, in_place: Callable = is_static_address,
                 in_place_at: frozenset[int] = frozenset(), capture: Callable | None = None,
                 free_fraction: Callable[[list], float] | None = None,
                 borrow_outputs: bool = False):
        if max_graphs < 1 or capture_after < 1:
            raise ValueError("max_graphs and capture_after must be >= 1")
        self.run = run
        self.borrow_outputs = borrow_outputs
        self.max_graphs, self.capture_after = max_graphs, capture_after
        self.min_free_fraction = min_free_fraction
        self.in_place, self.in_place_at = in_place, in_place_at
        self._capture = capture or self._cuda_capture
        self._pool = None
        # a custom capture (a fake one on CPU) has no device memory to watch unless told
        self._free_fraction = free_fraction or (cuda_free_fraction if capture is None
                                                else lambda inputs: 1.0)
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: dict[tuple, int] = {}      # keys not captured yet: times seen
        self._uncapturable: set[tuple] = set()
        self._last: _LastReplay | None = None  # holds tensors only while its graph is kept
        self._lock = threading.Lock()
        self.stats = GraphStats()

    def _cuda_capture(self, run: Callable, static_inputs: list):
        device = cuda_device(static_inputs)
        if self._pool is None or self._pool[0] != device:  # graphs on a device share a pool:
            with torch.cuda.device(device):                # they never run together
                self._pool = device, torch.cuda.graph_pool_handle()
        return cuda_capture(run, static_inputs, self._pool[1])

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[tuple]:
        return list(self._graphs)

    def __call__(self, key: tuple, *inputs, select: Callable | None = None):
        """`run(*inputs)`, through the graph captured for `key` (plus the tensor inputs' shapes
        and dtypes, the addresses of the in-place ones and the other inputs' values) when there
        is one. `select(outputs)` picks what the call returns (views of them): after a replay
        that part alone is copied out (unless borrowed)."""
        with self._lock:
            graph = self._repeated(key, inputs)
            self.stats.repeats += graph is not None
            if graph is None:
                input_keys = self._input_keys(inputs)
                full_key = (key, input_keys)
                graph = self._graphs.get(full_key)
                if graph is None and full_key not in self._uncapturable:
                    if len(self._seen) >= _MAX_SEEN:  # shapes that never repeat: forget them
                        self._seen.clear()
                    self._seen[full_key] = self._seen.get(full_key, 0) + 1
                    if self._seen[full_key] >= self.capture_after:
                        graph = self._try_capture(full_key, inputs)
                if graph is not None:
                    self._graphs.move_to_end(full_key)
                    self._remember(key, graph, inputs, input_keys)
            if graph is not None:
                for position, buffer in graph.copied:
                    buffer.copy_(inputs[position])
                graph.replay()
                self.stats.replays += 1
                outputs = graph.outputs if select is None else select(graph.outputs)
                return outputs if self.borrow_outputs else _clone_outputs(outputs)
            self.stats.eager_calls += 1
        outputs = self.run(*inputs)
        return outputs if select is None else select(outputs)

    def _reads_in_place(self, position: int, value) -> bool:
        return isinstance(value, torch.Tensor) and (position in self.in_place_at
                                                    or self.in_place(value))

    def _input_keys(self, inputs, positions=None) -> tuple:
        """Per input (at `positions`, default all): a tensor's shape, dtype and (read in place)
        address, else its value. One pass: a decode step has two cache tensors per layer."""
        in_place, at = self.in_place, self.in_place_at
        indexed = enumerate(inputs) if positions is None else ((i, inputs[i]) for i in positions)
        return tuple((v.shape, v.dtype, v.data_ptr() if i in at or in_place(v) else None)
                     if isinstance(v, torch.Tensor) else _frozen(v) for i, v in indexed)

    def _repeated(self, key: tuple, inputs) -> _Graph | None:
        """The last replayed graph, if this call is one to it again (see the module
        docstring); else None."""
        last = self._last
        if (last is None or len(inputs) != last.size or key != last.key
                or not all(map(operator.is_, map(inputs.__getitem__, last.in_place),
                               last.objects))
                or self._input_keys(inputs, last.others) != last.others_key):
            return None
        return last.graph

    def _remember(self, key: tuple, graph: _Graph, inputs, input_keys: tuple) -> None:
        in_place = tuple(i for i, v in enumerate(inputs) if self._reads_in_place(i, v))
        others = tuple(sorted(set(range(len(inputs))) - set(in_place)))
        self._last = _LastReplay(key, graph, len(inputs), in_place,
                                 tuple(inputs[i] for i in in_place), others,
                                 tuple(input_keys[i] for i in others))

    def _try_capture(self, key: tuple, inputs) -> _Graph | None:
        copied = [isinstance(v, torch.Tensor) and not self._reads_in_place(i, v)
                  for i, v in enumerate(inputs)]
        try:
            if self._free_fraction(inputs) < self.min_free_fraction:
                self.stats.memory_fallbacks += 1
                return None
            static = [v.clone() if copy else v for v, copy in zip(inputs, copied)]
            written = [(inputs[i], inputs[i].clone()) for i in sorted(self.in_place_at)
                       if isinstance(inputs[i], torch.Tensor)]
            try:
                replay, outputs = self._capture(self.run, static)
            finally:  # the capture's runs (warm-up) leave the written inputs as they were
                for tensor, before in written:
                    tensor.copy_(before)
        except torch.OutOfMemoryError:
            self.stats.memory_fallbacks += 1
            return None
        except RuntimeError as exc:  # an op that cannot be captured (a host sync, say)
            logger.warning("cannot capture a CUDA graph for %s: %s; running it eagerly", key[0],
                           first_line(exc))
            self._uncapturable.add(key)
            self._seen.pop(key, None)
            self.stats.capture_failures += 1
            return None
        while len(self._graphs) >= self.max_graphs:  # evicted once the new one is captured
            self._graphs.popitem(last=False)
            self._last = None
            self.stats.evictions += 1
        graph = self._graphs[key] = _Graph(
            replay, static, [(i, static[i]) for i, copy in enumerate(copied) if copy], outputs)
        del self._seen[key]
        self.stats.captures += 1
        return graph

    def forget(self, tensors) -> None:
        """Drop the graphs that read (views of) any of `tensors` in place: tensors their owner
        will not use again (a K/V set the pool dropped, an engine's cache before it grew),
        which those graphs would keep in memory until evicted."""
        storages = {tensor.untyped_storage().data_ptr() for tensor in tensors}
        with self._lock:
            for key in [key for key, graph in self._graphs.items()
                        if any(self._reads_in_place(i, value)
                               and value.untyped_storage().data_ptr() in storages
                               for i, value in enumerate(graph.inputs))]:
                del self._graphs[key]
                self.stats.released += 1
                self._last = None

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._last = None
            self._seen.clear()
            self._uncapturable.clear()
