"""Calibration of prefill precisions: a prompt prefilled at int8 (activations quantized per
token, kernels/token_int8.py), measured as it is used.

A prefill's own logits are thrown away but for its last position; what it leaves behind is the
K/V cache that every later token reads. So each held-out window's first half is prefilled at
the level and its second half is decoded (teacher-forced, one step) at each measured decode
level; the first token's logits and the second half's are scored against the full path's
(quality.quality_loss, the guard's unit), against the full path's own score on the same
positions. The prefill's speedup over fp32 is timed on a prompt of up to `TIMING_TOKENS` tokens.
"""
from __future__ import annotations

import statistics
import time

import torch

from rbcompile.artifact import quality
from rbcompile.artifact.executors import StoredPrecision, StoredPrefill
from rbcompile.artifact.packed_weights import level_precision, prefill_precision
from rbcompile.artifact.step_executor import FULL_PRECISION_FROM, scratch_cache
from rbcompile.progress import say

PREFILL_LEVEL = "int8"
TIMING_TOKENS, TIMING_ROUNDS = 512, 5
MIN_TIMING_TOKENS = 64   # a shorter prompt times the step's overhead, not its GEMMs


def measure_prefill(measure, levels: list[StoredPrecision],
                    level: str = PREFILL_LEVEL) -> StoredPrefill:
    """`level`'s prefill measured with every decode level in `levels` (and fp32) on
    `measure`'s held-out batches (a precision.DecoderQuality), and timed against fp32."""
    executor = measure.compiled.decoder.step_executor
    linears = executor.linear_weights()
    prefill = prefill_precision(level, linears)
    full = after_prefill(measure, None, None)
    losses, heldout = {}, {}
    for decode in ("fp32", *(stored.level for stored in levels)):
        measured = after_prefill(measure, prefill, level_precision(decode, linears))
        losses[decode] = quality.quality_loss(measured, full)
        heldout = heldout or measured
        say(f"  {level} prefill, {decode} decode: top-1 agreement "
            f"{measured['top1_agreement']:.3f}, quality loss {losses[decode]:.3f}")
    tokens, speedup = prefill_speedup(measure.compiled, measure.batches, prefill)
    if speedup is not None:
        say(f"  {level} prefill of {tokens} tokens: {speedup:.2f}x fp32")
    return StoredPrefill(level, losses, heldout, speedup, tokens)


def after_prefill(measure, prefill: dict | None, decode: dict | None) -> dict:
    """The held-out measures of the positions after each window's first half, prefilled at
    `prefill` and decoded at `decode` (precision per linear; None: fp32)."""
    executor = measure.compiled.decoder.step_executor
    kv_heads, head_dim, layers = measure.dims
    executor.full_precision_from = None      # each step at the precision it is given
    parts = []
    for (ids, mask), reference in zip(measure.batches, measure.references):
        rows, tokens = ids.shape
        split = tokens // 2
        cache = scratch_cache(rows, kv_heads, tokens, head_dim, layers)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        slots = torch.arange(tokens)
        first = executor.run(ids[:, :split], mask[:, :split], positions[:, :split].contiguous(),
                             slots[:split], torch.tensor([split - 1]), cache, precision=prefill)
        rest = executor.run(ids[:, split:].contiguous(), mask, positions[:, split:].contiguous(),
                            slots[split:], torch.arange(tokens - split), cache, precision=decode)
        parts.append(quality.measure("decoder", {"logits": torch.cat([first, rest], 1)},
                                     ids[:, split - 1:], mask[:, split - 1:],
                                     reference[:, split - 1:]))
    return quality.summarise("decoder", parts)


def timing_tokens(batches, limit: int) -> torch.Tensor | None:
    """[1, N] real tokens of `batches` for timing a prefill (N <= `limit`; None: too few)."""
    tokens = torch.cat([ids[mask.bool()] for ids, mask in batches])[:limit]
    return tokens[None] if len(tokens) >= MIN_TIMING_TOKENS else None


def prefill_speedup(compiled, batches, prefill: dict) -> tuple[int, float | None]:
    """(prompt tokens, fp32 prefill time over `prefill`'s: median of TIMING_ROUNDS, the two
    interleaved, each warmed up first); (0, None) where the held-out text is too short."""
    executor, shape = compiled.decoder.step_executor, compiled.decoder.shape
    prompt = timing_tokens(batches, min(TIMING_TOKENS, compiled.max_positions))
    if prompt is None:
        return 0, None
    tokens = prompt.shape[1]
    executor.full_precision_from = FULL_PRECISION_FROM
    prepack, executor.prepack = executor.prepack, True   # fp32 as a served fp32 decoder runs it
    times: dict[str, list[float]] = {"fp32": [], "low": []}
    try:
        _time_rounds(executor, shape, prompt, prefill, times)
    finally:
        executor.prefill_precision, executor.prepack = None, prepack
    return tokens, statistics.median(times["fp32"]) / statistics.median(times["low"])


def _time_rounds(executor, shape, prompt: torch.Tensor, prefill: dict, times: dict) -> None:
    """TIMING_ROUNDS prefills of `prompt` at fp32 and at `prefill` in turn into `times`, after a
    round that builds the sessions."""
    tokens = prompt.shape[1]
    for round_ in range(TIMING_ROUNDS + 1):
        for name, precision in (("fp32", None), ("low", prefill)):
            executor.prefill_precision = precision
            cache = scratch_cache(1, shape.kv_heads, tokens, shape.head_dim, shape.layers)
            slots = torch.arange(tokens)
            start = time.perf_counter()
            executor(prompt, torch.ones_like(prompt), slots[None], slots,
                     torch.tensor([tokens - 1]), cache)
            if round_:   # the first round builds the sessions
                times[name].append(time.perf_counter() - start)
