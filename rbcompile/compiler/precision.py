"""Calibration of weight precisions: each level's quality against the full path on the
held-out batches, through the onnxruntime step executor (rbcompile/artifact/executors.py).

A level is measured as the decoder runs it: every linear (block projections and the
vocabulary head) at that precision, prefilled over each held-out batch; next-token loss,
perplexity and top-1 agreement with the full path go through quality.quality_loss, the
guard's unit. The fp32 full path of the same executor is measured too, as a check that the
executor itself costs nothing. Each calibrated plan that skips work in the decoder is measured
again at every level (skipping and precision together), so the guard bounds the pair that runs.
Each level's batch-1 decode step is timed against fp32's (`--weights auto` picks by it).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from rbcompile.artifact import quality
from rbcompile.artifact.executors import (
    WEIGHT_LEVELS,
    StoredPrecision,
    StoredPrefill,
    onnxruntime_reason,
)
from rbcompile.artifact.plans import StoredPlan
from rbcompile.errors import UserError
from rbcompile.progress import say

# Deferred on purpose: onnx and onnxruntime load when a precision is measured, not with the
# compiler (they add to every compile's start).

LOW_LEVELS = tuple(level for level in WEIGHT_LEVELS if level != "fp32")
PROMPT_TOKENS, STEPS, ROUNDS = 64, 32, 3   # the decode steps timed per level
ROWS = (1, 2, 8)   # batch sizes each level's decode step is timed at (kernels change)


def timing_prompt(compiled, batches) -> tuple[torch.Tensor, int]:
    """(prompt [1, P], steps) for timing decode steps: the first batch's first row, cut so
    that the prompt and the steps fit the model's positions."""
    steps = min(STEPS, compiled.max_positions // 2)
    return batches[0][0][:1, :min(PROMPT_TOKENS, compiled.max_positions - steps)], steps


def run_at_level(compiled, level: str) -> None:
    """Every decode step and prefill at `level` (what measuring a level needs): the executor
    at that level without its fallbacks to fp32 for prefills and larger batches."""
    compiled.use_executor("onnxruntime", level)
    compiled.decoder.executor.full_precision_from = None
    compiled.decoder.executor.full_precision_rows = None


def decode_step_seconds(compiled, level: str, gates, prompt: torch.Tensor, steps: int) -> float:
    """The median time of `steps` greedy decode steps with every step's linears at `level` and
    decoder `gates` (None: all on), after prefilling `prompt` [B, P] (not counted)."""
    from rbcompile.artifact.step_executor import scratch_cache

    decoder, shape = compiled.decoder, compiled.decoder.shape
    run_at_level(compiled, level)
    gates = None if gates is None else list(gates)
    rows, tokens = prompt.shape
    total = tokens + steps
    cache = scratch_cache(rows, shape.kv_heads, total, shape.head_dim, shape.layers)
    mask = torch.ones(rows, total, dtype=torch.long)
    slots = torch.arange(tokens)
    logits = decoder(prompt.contiguous(), mask[:, :tokens], slots.expand(rows, -1).contiguous(),
                     slots, torch.tensor([tokens - 1]), cache, gates)
    times = []
    for position in range(tokens, total):
        token = logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        logits = decoder(token, mask[:, :position + 1], torch.full((rows, 1), position),
                         torch.tensor([position]), torch.tensor([0]), cache, gates)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def level_speedups(compiled, batches, levels: tuple[str, ...]
                   ) -> dict[str, tuple[tuple[int, float], ...]]:
    """Each level's decode step speedup over fp32 at each of ROWS (the prompt's row repeated;
    median of ROUNDS, levels interleaved): int4 kernels that win at one row lose at several."""
    prompt, steps = timing_prompt(compiled, batches)
    prompt, steps = prompt[:, :PROMPT_TOKENS // 2], min(steps, 12)
    speedups: dict[str, list[tuple[int, float]]] = {level: [] for level in levels}
    for rows in ROWS:
        times: dict[str, list[float]] = {level: [] for level in ("fp32", *levels)}
        for _ in range(ROUNDS):
            for level in times:
                times[level].append(decode_step_seconds(compiled, level, None,
                                                        prompt.expand(rows, -1), steps))
        full = statistics.median(times["fp32"])
        for level in levels:
            speedups[level].append((rows, full / statistics.median(times[level])))
    return {level: tuple(pairs) for level, pairs in speedups.items()}


@dataclass(frozen=True)
class MeasuredPrecisions:
    """What `measure_precisions` measured: the weight levels, the plans with their losses at
    them, and the prefill levels (the manifest's `precisions`, `plans`, `prefill_precisions`)."""
    levels: list[StoredPrecision]
    plans: list[StoredPlan] | None
    prefills: list[StoredPrefill]


class DecoderQuality:
    """Quality of the decoder at a weight level and gates, on `batches`, against the full
    path (the references are computed once)."""

    def __init__(self, compiled, batches):
        from rbcompile.artifact.step_executor import sequence_logits

        self.compiled, self.batches, self.sequence_logits = compiled, batches, sequence_logits
        shape = compiled.decoder.shape
        self.dims = (shape.kv_heads, shape.head_dim, shape.layers)
        self.references = [quality.reference("decoder", compiled(ids, mask), mask)
                           for ids, mask in batches]
        self.full = self.summary(compiled.decoder)

    def summary(self, step) -> dict:
        parts = [quality.measure("decoder", {"logits": self.sequence_logits(step, ids, mask,
                                                                             *self.dims)},
                                 ids, mask, reference)
                 for (ids, mask), reference in zip(self.batches, self.references)]
        return quality.summarise("decoder", parts)

    def at(self, level: str, gates=None) -> dict:
        """The held-out measures with every linear at `level` and the decoder's `gates`."""
        run_at_level(self.compiled, level)
        decoder = self.compiled.decoder
        return self.summary(lambda *step: decoder(*step, gates=gates))


def measure_precisions(compiled, batches, levels: tuple[str, ...],
                       plans: list[StoredPlan] | None = None) -> MeasuredPrecisions:
    """Each of `levels` measured on `batches` ([(input_ids, mask)]) against the full path,
    `plans` with their `precision_losses` at those levels (a plan whose decoder skips nothing
    costs what its level costs), and the int8 prefill with each of them
    (compiler/prefill_precision.py)."""
    if not levels:
        return MeasuredPrecisions([], plans, [])
    reason = onnxruntime_reason(compiled)
    if reason is not None:
        raise UserError(f"cannot measure weight precisions: {reason} (compile with "
                        "--precisions none)")
    from rbcompile.artifact.step_executor import FULL_PRECISION_FROM
    from rbcompile.compiler.prefill_precision import measure_prefill

    measure = DecoderQuality(compiled, batches)
    decoder = compiled.decoder
    previous = None if decoder.executor is None else decoder.weights   # None: torch
    prefill = decoder.prefill
    try:
        speedups = level_speedups(compiled, batches, levels)
        for level, pairs in speedups.items():
            say(f"  {level} decode step against fp32 at " + ", ".join(
                f"{rows} row{'s' * (rows > 1)} {speedup:.2f}x" for rows, speedup in pairs))
        stored = [replace(level, speedups=speedups[level.level])
                  for level in _levels(measure, levels)]
        plans = plans and _plans_at_levels(measure, plans, stored)
        prefills = [measure_prefill(measure, stored)]
    finally:
        if decoder.step_executor is not None:
            decoder.step_executor.full_precision_from = FULL_PRECISION_FROM
        if previous is None:
            compiled.use_executor("torch")
        else:
            compiled.use_executor("onnxruntime", previous, decoder.step_executor.threads,
                                  prefill)
    return MeasuredPrecisions(stored, plans, prefills)


def _levels(measure: DecoderQuality, levels: tuple[str, ...]) -> list[StoredPrecision]:
    full, stored = measure.full, []
    for level in ("fp32", *levels):
        measured = measure.at(level)
        loss = quality.quality_loss(measured, full)
        say(f"  {level} weights: perplexity {measured['perplexity']:.2f} (full path "
            f"{full['perplexity']:.2f}), top-1 agreement {measured['top1_agreement']:.3f}, "
            f"quality loss {loss:.3f}")
        if level != "fp32":
            stored.append(StoredPrecision(level, loss, measured))
    return stored


def _plans_at_levels(measure: DecoderQuality, plans: list[StoredPlan],
                     levels: list[StoredPrecision]) -> list[StoredPlan]:
    compiled, measured = measure.compiled, {}
    out = []
    for plan in plans:
        gates = compiled.decoder_gates(plan.budget) if plan.budget > 0 else None
        key = None if gates is None or all(gates) else tuple(gates)
        losses = []
        for level in levels:
            if key is None:
                losses.append((level.level, level.decoder_quality_loss))
                continue
            if (key, level.level) not in measured:
                at = measure.at(level.level, list(key))
                measured[key, level.level] = quality.quality_loss(at, measure.full)
                say(f"  budget {plan.budget:g} with {level.level} weights: perplexity "
                    f"{at['perplexity']:.2f}, top-1 agreement {at['top1_agreement']:.3f}, "
                    f"quality loss {measured[key, level.level]:.3f}")
            losses.append((level.level, measured[key, level.level]))
        out.append(replace(plan, precision_losses=tuple(sorted(losses))) if plan.budget > 0
                   else plan)
    return out
