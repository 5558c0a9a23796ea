"""The order in which a decode controller spends its lossy levers: lower weight precision first,
then skipping (issue 46).

Both are measured at compile on held-out text (the manifest's `precisions` and plans): on
small decoders a skip plan costs far more top-1 agreement per saved millisecond than a lower
weight level does (docs/executor.md, "Precision and skipping on one frontier"), so a controller
under load moves rows to lower precision before it skips. The lossless levers come before both
and need no controller: continuous batching, and drafting while it pays (`speculate="auto"`
stops drafting in crowded batches).
"""
from __future__ import annotations

import math

from rbcompile.artifact.executors import level_loss, stored_precisions
from rbcompile.artifact.guard import QualityGuard


def precision_ladder(manifest: dict, guard: QualityGuard, decoding: str,
                     prefill: str = "fp32") -> tuple[str, ...]:
    """The weight levels a controller moves requests to before it skips, in order: the
    measured levels below the decoding one that `guard` allows (after prompts prefilled at
    `prefill`), by measured quality loss, each kept only when its decode step measured faster
    than every rung before it (a level no faster than a less lossy one never pays for its
    loss). Speed is the one timed at the largest batch size (a controller acts when batches
    are full)."""
    levels = stored_precisions(manifest)
    decoding_level = levels.get(decoding)
    best = _loaded_speedup(decoding_level) if decoding_level else 1.0
    ladder = []
    losses = {name: level_loss(manifest, name, prefill) for name in levels}
    unmeasured_last = {name: math.inf if loss is None else loss for name, loss in losses.items()}
    for level in sorted(levels.values(), key=lambda level: unmeasured_last[level.level]):
        speedup = _loaded_speedup(level)
        if level.level != decoding and guard.allows(losses[level.level]) and speedup > best:
            ladder.append(level.level)
            best = speedup
    return tuple(ladder)


def served_ladder(compiled) -> tuple[str, ...]:
    """`precision_ladder` of an artifact as it runs (its guard, the level it decodes at);
    none without the onnxruntime executor, which is what runs lower levels."""
    decoder = compiled.decoder
    if decoder is None or decoder.executor is None:
        return ()
    return precision_ladder(compiled.manifest, compiled.guard, decoder.weights, decoder.prefill)


def _loaded_speedup(level) -> float:
    """A level's decode-step speedup at the largest batch size timed (0: never timed)."""
    return level.speedups[-1][1] if level.speedups else 0.0
