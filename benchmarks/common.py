"""Shared benchmark helpers: pinned threads, models, interleaved timing, medians, tables, JSON,
op counts."""
from __future__ import annotations

import collections
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA = Path(__file__).parent / "data"
RESULTS = Path(__file__).parent / "results"


def pin_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def load_executed(artifact: str, threads: int):
    """`artifact` loaded with its decoder on the onnxruntime executor at fp32, torch and
    onnxruntime pinned to `threads` (onnxruntime's sessions on one shared pool)."""
    import rbcompile
    from rbcompile.artifact.ort_threads import share_threads

    pin_threads(threads)
    share_threads(threads)
    model = rbcompile.load(artifact)
    model.use_executor("onnxruntime", "fp32", threads=threads)
    return model


def load_with_eager(name: str):
    """(CompiledModel, eager transformers model) of an artifact folder or a bundled name
    (compiled here, without calibration). Every plan may run (rbcompile/artifact/guard.py): the
    benchmarks time plans and measure their quality beside them."""
    import rbcompile
    from rbcompile.artifact.guard import UNGUARDED
    from rbcompile.artifact.models import load_hf_model, resolve_checkpoint

    if Path(name).is_dir():
        compiled = rbcompile.load(name)
        eager = load_hf_model(resolve_checkpoint(compiled.manifest["source"]["path"]))
    else:
        compiled, eager = rbcompile.compile(name), load_hf_model(resolve_checkpoint(name))
    compiled.guard = UNGUARDED
    return compiled, eager


def text_windows(tokenizer, batch: int, seq: int, file: str = "emma-excerpt.txt"):
    """`batch` consecutive windows of `seq` real tokens from a committed public-domain text."""
    ids = tokenizer((DATA / file).read_text(), return_tensors="pt")["input_ids"][0]
    needed = batch * seq
    if ids.numel() < needed:
        raise SystemExit(f"{file} has {ids.numel()} tokens, need {needed}")
    input_ids = ids[:needed].view(batch, seq)
    return input_ids, torch.ones_like(input_ids)


def interleaved_medians(contenders: dict, rounds: int, warmup: int = 2) -> dict[str, dict]:
    """Time each contender once per round, in turn, so drift hits all alike; median per name.
    Odd rounds run in reverse order (ABBA), so no contender always follows the same one."""
    samples = {name: [] for name in contenders}
    for round_index in range(warmup + rounds):
        order = list(contenders.items())
        for name, fn in (order[::-1] if round_index % 2 else order):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                samples[name].append(elapsed)
        print(f"  round {round_index + 1}/{warmup + rounds}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {name: {"median_ms": 1e3 * statistics.median(times),
                   "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times), "rounds": len(times)}
            for name, times in samples.items()}


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, header). Values are printed as given (format them before)."""
    cells = [[h for _, h in columns]] + [[str(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i and j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict, path: str | Path | None = None) -> Path:
    """`payload` with the machine and the time, to `path` (default results/NAME.json)."""
    path = RESULTS / f"{name}.json" if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "torch": torch.__version__, "threads": torch.get_num_threads()},
               "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=1))
    return path


class OpCounter(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it, by name (`ops`); views and size queries are
    left out: they launch no kernel."""

    NOT_KERNELS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.sym_size.int,
                   torch.ops.aten.sym_stride.int}

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in self.NOT_KERNELS:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
