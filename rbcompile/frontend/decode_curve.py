"""The decode frontier (`rbcompile curve --decode`): what each way of making a decode step
lighter costs in quality and saves in time, measured side by side on held-out text.

Every setting pairs a weight level (fp32, int8, int4: the onnxruntime step executor's) with a
skip plan (the calibrated plans that skip decoder MLPs, else the fixed skip order at
DEFAULT_BUDGETS: plans that only narrow widths run the whole decoder): quality is the
KV-cached decoder's on the eval windows against the fp32 full path (perplexity, top-1
agreement, quality.quality_loss); time is the median batch-1 decode step after a prompt, the
settings interleaved round by round. `dominance` answers the frontier's question: for each
skip-only plan, is there a lower-precision setting at least as fast that costs less quality?
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from rbcompile.artifact import quality
from rbcompile.artifact.executors import WEIGHT_LEVELS, onnxruntime_reason, stored_precisions
from rbcompile.artifact.plans import plan_for_budget
from rbcompile.errors import UserError
from rbcompile.frontend.curve import save_plot
from rbcompile.progress import say

# Deferred on purpose: matplotlib (optional) loads only to draw a plot.

DEFAULT_BUDGETS = (0.05, 0.1, 0.25, 0.5)   # an uncalibrated artifact's fixed skip order


@dataclass(frozen=True)
class DecodeSetting:
    """One point of the frontier: decoder `gates` (None: every MLP runs) of `budget` with every
    linear at weight `level`."""
    level: str
    budget: float
    gates: tuple[bool, ...] | None

    @property
    def label(self) -> str:
        return self.level if self.budget == 0 else f"{self.level} + budget {self.budget:g}"


@dataclass
class DecodePoint:
    """A setting as measured: quality against the fp32 full path and the decode step's time."""
    label: str
    level: str
    budget: float
    skipped_mlps: int
    perplexity: float
    top1_agreement: float
    quality_loss: float
    step_ms: float
    speedup: float = 1.0


def settings(compiled, levels: tuple[str, ...] | None = None) -> list[DecodeSetting]:
    """Each weight level (default: fp32 and the levels the artifact measured, else all) times
    each skip plan whose decoder skips something, full path first."""
    reason = onnxruntime_reason(compiled)
    if reason is not None:
        raise UserError(f"--decode needs the onnxruntime step executor: {reason}")
    levels = levels or ("fp32", *(stored_precisions(compiled.manifest) or WEIGHT_LEVELS[1:]))
    plans = [(0.0, None)] + (_skipping(compiled, [(plan.budget, compiled.decoder_gates(plan.budget))
                                                  for plan in compiled.plans or []])
                             or _skipping(compiled, [(budget, _fixed_order(compiled, budget))
                                                     for budget in DEFAULT_BUDGETS]))
    return [DecodeSetting(level, budget, gates) for level in levels for budget, gates in plans]


def _fixed_order(compiled, budget: float) -> list[bool]:
    """The decoder gates of the fixed skip order (plans.skip_order) at `budget`."""
    gates = plan_for_budget(compiled.regions, budget).gates
    return compiled.decoder.gates_from(compiled.regions, gates)


def _skipping(compiled, candidates) -> list[tuple[float, tuple[bool, ...]]]:
    """The (budget, decoder gates) of `candidates` that skip something, each setting once (a
    calibrated plan that only narrows widths runs the whole decoder)."""
    out, seen = [], set()
    for budget, gates in candidates:
        if gates is not None and not all(gates) and tuple(gates) not in seen:
            seen.add(tuple(gates))
            out.append((budget, tuple(gates)))
    return out


def frontier(compiled, batches, *, rounds: int = 3,
             levels: tuple[str, ...] | None = None) -> list[DecodePoint]:
    """Every setting's quality on `batches` ([(input_ids, mask)]) and decode step time
    (median of `rounds`, interleaved)."""
    from rbcompile.compiler.precision import DecoderQuality, decode_step_seconds, timing_prompt

    chosen = settings(compiled, levels)
    measure = DecoderQuality(compiled, batches)
    measured = {}
    for index, setting in enumerate(chosen, 1):
        measured[setting] = measure.at(setting.level, None if setting.gates is None
                                       else list(setting.gates))
        say(f"  quality {index}/{len(chosen)}: {setting.label}: perplexity "
            f"{measured[setting]['perplexity']:.2f}")
    prompt, steps = timing_prompt(compiled, batches)
    times: dict[DecodeSetting, list[float]] = {setting: [] for setting in chosen}
    for round_index in range(rounds):
        for setting in chosen:
            times[setting].append(decode_step_seconds(compiled, setting.level, setting.gates,
                                                      prompt, steps))
        say(f"  decode-step round {round_index + 1}/{rounds}")
    full = statistics.median(times[chosen[0]])
    # losses against the first setting (the full path) on the same executor: the torch
    # decoder's perplexity differs from onnxruntime's in the 7th digit
    reference = next((measured[s] for s in chosen if s.level == "fp32" and s.gates is None),
                     measure.full)
    points = []
    for setting in chosen:
        seconds, heldout = statistics.median(times[setting]), measured[setting]
        points.append(DecodePoint(
            setting.label, setting.level, setting.budget,
            0 if setting.gates is None else setting.gates.count(False),
            heldout["perplexity"], heldout["top1_agreement"],
            quality.quality_loss(heldout, reference), 1000 * seconds, full / seconds))
    return points


@dataclass
class Dominance:
    """A skip-only plan against the best lower-precision setting at least as fast."""
    skip_only: str
    skip_loss: float
    skip_speedup: float
    rival: str | None       # None: no lower-precision setting is as fast
    rival_loss: float | None
    rival_speedup: float | None

    @property
    def holds(self) -> bool:
        return self.rival_loss is not None and self.rival_loss <= self.skip_loss


def dominance(points: list[DecodePoint]) -> list[Dominance]:
    """For each fp32 skip plan: the lowest-loss setting with lower-precision weights whose step
    is at least as fast (the frontier's claim: precision before skipping)."""
    out = []
    for skip in (p for p in points if p.level == "fp32" and p.budget > 0):
        rivals = [p for p in points if p.level != "fp32" and p.speedup >= skip.speedup]
        best = min(rivals, key=lambda p: p.quality_loss, default=None)
        out.append(Dominance(skip.label, skip.quality_loss, skip.speedup,
                             best and best.label, best and best.quality_loss,
                             best and best.speedup))
    return out


def as_json(points: list[DecodePoint]) -> dict:
    return {"points": [asdict(p) for p in points],
            "dominance": [{**asdict(d), "holds": d.holds} for d in dominance(points)]}


def format_table(points: list[DecodePoint]) -> str:
    lines = [f"{'setting':<24} {'MLPs off':>8} {'step ms':>8} {'speedup':>8} {'perplexity':>10} "
             f"{'top-1':>7} {'loss':>6}"]
    for p in points:
        lines.append(f"{p.label:<24} {p.skipped_mlps:8d} {p.step_ms:8.2f} {p.speedup:7.2f}x "
                     f"{p.perplexity:10.2f} {p.top1_agreement:7.1%} {p.quality_loss:6.3f}")
    for d in dominance(points):
        if d.rival is None:
            lines.append(f"{d.skip_only}: no lower-precision setting is as fast")
        else:
            verdict = "no more" if d.holds else "MORE"
            lines.append(f"{d.skip_only} ({d.skip_speedup:.2f}x, loss {d.skip_loss:.3f}): "
                         f"{d.rival} is as fast ({d.rival_speedup:.2f}x) with {verdict} loss "
                         f"({d.rival_loss:.3f})")
    return "\n".join(lines)


def plot(points: list[DecodePoint], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for level in dict.fromkeys(p.level for p in points):
        series = sorted((p for p in points if p.level == level), key=lambda p: p.budget)
        ax.plot([p.speedup for p in series], [p.perplexity for p in series], "o-",
                label=f"{level} weights, skip plans by budget")
        for p in series:
            ax.annotate(f"{p.budget:g}", (p.speedup, p.perplexity), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
    ax.set_yscale("log")
    save_plot(fig, ax, title, ("decode step speedup over the fp32 full path (x, batch 1)",
                               "held-out perplexity"), path)
