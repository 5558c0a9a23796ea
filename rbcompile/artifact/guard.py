"""The quality guard: which plans a budget may run, by their measured quality cost.

Calibration stores on every plan its quality loss on held-out text (quality.quality_loss):
`quality_loss` for the whole-sequence graph, and for decoders `decoder_quality_loss` for what
the KV-cached decoder runs of it (its MLP skips), and that again at each lower weight precision
(`decoder_path`). A plan never measured (an uncalibrated
artifact's fixed skip order, an artifact from before the loss was stored, the torch.compile
backend's graphs) has no loss. A `QualityGuard` lets a budget run the plan of the largest budget
at or under it whose measured loss is within `max_quality_loss`; unmeasured plans only with
`allow_unmeasured`. Whoever asks (a CLI flag, a request field, a controller) gets a
`GuardedPlan` saying what runs and why it is less than asked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rbcompile.artifact.plans import StoredPlan, check_budget, within_budget

# A lossy plan may change at most 3% of next tokens (and raise perplexity at most 3%): about
# what running SmolLM2 in bf16 instead of fp32 costs (docs/quality-guard.md).
DEFAULT_MAX_QUALITY_LOSS = 0.03

FORWARD, DECODER = "quality_loss", "decoder_quality_loss"   # StoredPlan.loss of each path
# why a plan was withheld: its measured loss, no measurement, or serve's live checks
OVER_GUARD, UNMEASURED, OBSERVED = "over_guard", "unmeasured", "observed"
_WHY = {OVER_GUARD: "its measured quality loss is over the guard",
        UNMEASURED: "its plan was never measured",
        OBSERVED: "its live agreement checks were under the guard"}


def decoder_path(level: str, prefill: str = "fp32") -> str:
    """The StoredPlan.loss path of the KV-cached decoder with its weights at `level` and
    prompts prefilled at `prefill`: a plan's loss at fp32 does not bound what it costs at int4
    or after an int8 prefill, so each combination is measured on its own
    (compiler/precision.py) and unmeasured where it was not (plans are not measured with a
    prefill level: with one, every lossy plan is unmeasured)."""
    if prefill != "fp32":
        return f"{DECODER}@{level}+prefill-{prefill}"
    return DECODER if level == "fp32" else f"{DECODER}@{level}"


@dataclass(frozen=True)
class QualityGuard:
    """The most quality a budget may cost (`max_quality_loss`, see quality.quality_loss), and
    whether plans without a measured cost may run at all."""
    max_quality_loss: float = DEFAULT_MAX_QUALITY_LOSS
    allow_unmeasured: bool = False

    def __post_init__(self):
        loss = self.max_quality_loss
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not loss >= 0:
            raise ValueError(f"max_quality_loss must be a number >= 0 (inf: no bound), got "
                             f"{loss!r}")

    def allows(self, quality_loss: float | None) -> bool:
        """Whether a plan of this measured loss (None: unmeasured) may run."""
        if quality_loss is None:
            return self.allow_unmeasured
        return quality_loss <= self.max_quality_loss + 1e-12


UNGUARDED = QualityGuard(math.inf, allow_unmeasured=True)


@dataclass(frozen=True)
class GuardedPlan:
    """What a requested budget runs under a guard."""
    requested: float | None     # the budget asked for (None: none asked)
    budget: float               # the budget of the plan that runs (0.0: the full path)
    quality_loss: float | None  # that plan's measured loss (0.0 for the full path; None: unmeasured)
    withheld: str | None = None  # why a lossier plan was refused: OVER_GUARD, UNMEASURED, OBSERVED

    @property
    def lossy(self) -> bool:
        return self.budget > 0

    def describe(self) -> str:
        """One line: the plan that runs, and what was withheld."""
        loss = "unmeasured" if self.quality_loss is None else f"quality loss {self.quality_loss:.3f}"
        ran = "the full path" if not self.lossy else f"budget {self.budget:g} ({loss})"
        if self.withheld is None:
            return f"ran {ran}"
        return f"budget {self.requested:g} withheld ({_WHY[self.withheld]}): ran {ran}"

    def as_json(self) -> dict:
        return {"requested_budget": self.requested, "budget": self.budget,
                "quality_loss": self.quality_loss, "withheld": self.withheld}


def guard_budget(plans: list[StoredPlan] | None, budget: float | None, guard: QualityGuard,
                 key: str = FORWARD) -> GuardedPlan:
    """The plan `budget` may run under `guard`: of the stored plans at or under `budget`, the
    largest allowed; without stored plans (the fixed skip order, never measured) `budget`
    itself when unmeasured plans may run, else the full path."""
    if budget is None or check_budget(budget) == 0:
        return GuardedPlan(budget, 0.0, 0.0)
    if not plans:
        if guard.allow_unmeasured:
            return GuardedPlan(budget, budget, None)
        return GuardedPlan(budget, 0.0, 0.0, UNMEASURED)
    under = [plan for plan in plans if within_budget(plan.budget, budget)]
    asked = max(under, key=lambda plan: plan.budget)
    allowed = max((plan for plan in under if guard.allows(plan.loss(key))),
                  key=lambda plan: plan.budget)
    withheld = None
    if allowed is not asked:
        withheld = UNMEASURED if asked.loss(key) is None else OVER_GUARD
    return GuardedPlan(budget, allowed.budget, allowed.loss(key), withheld)


def lossy_budgets(plans: list[StoredPlan] | None, guard: QualityGuard, key: str = FORWARD) -> list[float]:
    """The budgets > 0 of the stored plans `guard` allows, ascending (an uncalibrated artifact:
    none, or [1.0] standing for any budget when unmeasured plans may run)."""
    if not plans:
        return [1.0] if guard.allow_unmeasured else []
    return sorted(plan.budget for plan in plans if plan.budget > 0 and guard.allows(plan.loss(key)))
