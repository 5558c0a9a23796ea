"""The quality loop of `rbcompile serve`: it bounds the budgets the resource loop may set.

The resource loop (a policy: static, PID on the decode-step latency, PPO) proposes a budget;
`QualityLoop.clamp` turns it into the budget that runs, and `bound` does the same, uncounted,
for the budget a request brings:
1. the compiled model's `QualityGuard` (rbcompile/artifact/guard.py): the plan of the largest budget
   at or under it whose measured quality loss (calibration, the decoder's plans) is within
   the guard; unmeasured plans only when the user allowed them;
2. the live checks: every light decode step of a plan until it has `min_checks` compared
   rows, then one in `check_every`, also runs the full path, whose tokens it then emits
   (engine.BatchEngine._checked_step), and counts the rows whose top-1 token agrees, per
   decoder plan (its gates). When the last `window` compared rows of a plan (at least
   `min_checks`) show, with 95% confidence (the Wilson lower bound), that more of its tokens
   change than the guard's `max_quality_loss`, that plan is withheld for the rest of the run,
   whatever the latency says: a calibrated artifact then runs the largest allowed plan with
   other gates; the fixed skip order (unmeasured plans, allowed) at most half the failed
   plan's skipped share, so a run of bad plans is left in a few steps.
Each decision that asked for more than it got is counted by reason (`withheld`).
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from rbcompile.artifact.guard import (
    DECODER,
    OBSERVED,
    OVER_GUARD,
    UNMEASURED,
    GuardedPlan,
    guard_budget,
)

CONFIDENCE_Z = 1.645    # one-sided 95%


@dataclass(frozen=True)
class QualityLoopConfig:
    """How often light decode steps are checked against the full path, and over how much."""
    check_every: int = 16    # light decode steps per sampled check (0: never check)
    window: int = 256        # compared rows kept per plan
    min_checks: int = 64     # compared rows before a plan can be withheld

    def __post_init__(self):
        if self.check_every < 0 or self.window < 1 or not 1 <= self.min_checks <= self.window:
            raise ValueError("check_every must be >= 0, window >= 1 and min_checks in "
                             "[1, window]")


def changed_lower_bound(changed: int, rows: int, z: float = CONFIDENCE_Z) -> float:
    """The Wilson score interval's lower end for the share of rows that changed."""
    if rows == 0:
        return 0.0
    share, z2 = changed / rows, z * z
    centre = share + z2 / (2 * rows)
    spread = z * math.sqrt(share * (1 - share) / rows + z2 / (4 * rows * rows))
    return max(0.0, (centre - spread) / (1 + z2 / rows))


class QualityLoop:
    """Bounds budgets by `compiled.guard` and the live checks (thread-safe)."""

    def __init__(self, compiled, config: QualityLoopConfig = QualityLoopConfig()):
        self.compiled, self.config = compiled, config
        self.ceiling = 1.0                  # fixed skip order: budgets above it are withheld
        self.withheld = {reason: 0 for reason in (UNMEASURED, OVER_GUARD, OBSERVED)}
        self.checked_rows = self.agreed_rows = 0
        self._light_steps = 0
        self._failed: set[tuple[bool, ...]] = set()          # decoder gates withheld live
        self._gates_of: dict[float, tuple[bool, ...]] = {}   # budget -> its decoder gates
        self._rows: dict[tuple[bool, ...], deque[bool]] = {}
        self._recent: deque[bool] = deque(maxlen=config.window)
        self._lock = threading.Lock()

    @property
    def max_quality_loss(self) -> float:
        return self.compiled.guard.max_quality_loss

    @property
    def _path(self) -> str:
        """The plans' loss path at the levels the decoder runs now (CompiledModel.loss_path)."""
        return self.compiled.loss_path(DECODER)

    def plan(self, budget: float | None) -> GuardedPlan:
        """The plan of `budget` under the guard and the live checks."""
        plan = guard_budget(self.compiled.plans, budget, self.compiled.guard, self._path)
        with self._lock:
            failed, ceiling = set(self._failed), self.ceiling
        if not plan.lossy or (self._gates(plan.budget) not in failed and plan.budget <= ceiling):
            return plan
        if not self.compiled.plans:
            lower = guard_budget(None, ceiling, self.compiled.guard, self._path)
            return GuardedPlan(budget, lower.budget, lower.quality_loss, OBSERVED)
        for lower_budget in sorted((p.budget for p in self.compiled.plans
                                    if p.budget < plan.budget), reverse=True):
            lower = guard_budget(self.compiled.plans, lower_budget, self.compiled.guard,
                                 self._path)
            if lower.budget == lower_budget and (not lower.lossy or
                                                 self._gates(lower.budget) not in failed):
                return GuardedPlan(budget, lower.budget, lower.quality_loss, OBSERVED)
        return GuardedPlan(budget, 0.0, 0.0, OBSERVED)

    def bound(self, budget: float | None) -> float | None:
        """The budget `budget` runs (None: the full path)."""
        return self.plan(budget).budget or None

    def clamp(self, budget: float | None) -> float | None:
        """`bound` for a controller's decision, counted by reason when less than asked."""
        plan = self.plan(budget)
        if plan.withheld is not None:
            with self._lock:
                self.withheld[plan.withheld] += 1
        return plan.budget or None

    def prefill_budget(self, budget: float | None) -> float | None:
        """`bound`, except that, with checks on, an unmeasured plan prefills on the full path
        until its checks have `min_checks` rows (decode steps are checked, prefills are not)."""
        plan = self.plan(budget)
        if plan.lossy and plan.quality_loss is None and self.config.check_every:
            with self._lock:
                window = self._rows.get(self._gates(plan.budget))
                if window is None or len(window) < self.config.min_checks:
                    return None
        return plan.budget or None

    def ceiling_budget(self) -> float:
        """The largest budget that runs as asked now."""
        return self.plan(1.0).budget

    def check_due(self, budget: float | None) -> bool:
        """Called before each light decode step of `budget`: whether to check it. Every step
        of a plan with fewer than `min_checks` compared rows (a new plan gets its verdict in a
        few steps), then one in `check_every`."""
        if not self.config.check_every:
            return False
        gates = self._gates(budget or 0.0)
        with self._lock:
            window = self._rows.get(gates)
            if window is None or len(window) < self.config.min_checks:
                return True
            self._light_steps += 1
            return self._light_steps % self.config.check_every == 0

    def checked(self, budget: float | None, agreed: int, rows: int) -> None:
        """A checked step of `budget`: `agreed` of `rows` kept the full path's top-1 token."""
        gates = self._gates(budget or 0.0)
        outcomes = [True] * agreed + [False] * (rows - agreed)
        with self._lock:
            self.checked_rows += rows
            self.agreed_rows += agreed
            self._recent.extend(outcomes)
            window = self._rows.setdefault(gates, deque(maxlen=self.config.window))
            window.extend(outcomes)
            changed = changed_lower_bound(window.count(False), len(window))
            if len(window) >= self.config.min_checks and changed > self.max_quality_loss:
                self._failed.add(gates)
                del self._rows[gates]
                if not self.compiled.plans:
                    share = self.compiled.skipped_share(self.compiled.gates_for_budget(budget))
                    self.ceiling = min(self.ceiling, share / 2)

    def agreement(self) -> float:
        """Top-1 agreement with the full path over the last `window` checked rows (1.0: none)."""
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else 1.0

    def _gates(self, budget: float) -> tuple[bool, ...]:
        """The decoder gates a budget's plan runs (() for the full path), worked out once per
        budget (the engine asks at every forward)."""
        if budget not in self._gates_of:
            self._gates_of[budget] = tuple(self.compiled.decoder_gates(budget) or ())
        return self._gates_of[budget]
