"""The quality loop of `rbcompile serve`: it bounds the budgets the resource loop may set.

The resource loop (a policy: static, PID on the decode-step latency, PPO) proposes a budget;
`QualityLoop.clamp` turns it into the budget that runs:
1. the compiled model's `QualityGuard` (rbcompile/guard.py): the plan of the largest budget
   at or under it whose measured quality loss (calibration, the decoder's plans) is within
   the guard; unmeasured plans only when the user allowed them;
2. the live ceiling: one light decode step in `check_every` also runs the full path first
   (engine.BatchEngine._checked_step) and counts the rows whose top-1 token agrees. When, over
   the last `window` compared rows of a plan (at least `min_checks`), the share that changed is
   over the guard's `max_quality_loss`, that plan and every lossier one are withheld for the
   rest of the run, whatever the latency says.
Each decision that asked for more than it got is counted by reason (`withheld`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..guard import DECODER, GuardedPlan, guard_budget

OBSERVED = "observed"   # a withheld reason beside guard.OVER_GUARD and guard.UNMEASURED
CEILING_EPS = 1e-6


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


class QualityLoop:
    """Clamps budgets to what `compiled.guard` and the live checks allow (thread-safe)."""

    def __init__(self, compiled, config: QualityLoopConfig = QualityLoopConfig()):
        self.compiled, self.config = compiled, config
        self.ceiling = 1.0                 # budgets above it are withheld (live checks)
        self.withheld = {reason: 0 for reason in ("unmeasured", "over_guard", OBSERVED)}
        self.checked_rows = self.agreed_rows = 0
        self._light_steps = 0
        self._rows: dict[float, deque[bool]] = {}
        self._recent: deque[bool] = deque(maxlen=config.window)
        self._lock = threading.Lock()

    @property
    def max_quality_loss(self) -> float:
        return self.compiled.guard.max_quality_loss

    def plan(self, budget: float | None) -> GuardedPlan:
        """The guarded plan of `budget`, under the live ceiling too."""
        plan = guard_budget(self.compiled.plans, budget, self.compiled.guard, DECODER)
        if plan.budget <= self.ceiling:
            return plan
        lower = guard_budget(self.compiled.plans, self.ceiling, self.compiled.guard, DECODER)
        return GuardedPlan(budget, lower.budget, lower.quality_loss, OBSERVED)

    def clamp(self, budget: float | None) -> float | None:
        """The budget a decision of `budget` runs (None: the full path); counted if withheld."""
        plan = self.plan(budget)
        if plan.withheld is not None:
            with self._lock:
                self.withheld[plan.withheld] += 1
        return plan.budget or None

    def check_due(self) -> bool:
        """Called before each light decode step: whether to check this one."""
        if not self.config.check_every:
            return False
        with self._lock:
            self._light_steps += 1
            return self._light_steps % self.config.check_every == 1 % self.config.check_every

    def checked(self, budget: float | None, agreed: int, rows: int) -> None:
        """A checked step of `budget`: `agreed` of `rows` kept the full path's top-1 token."""
        key = self._share(budget)
        outcomes = [True] * agreed + [False] * (rows - agreed)
        with self._lock:
            self.checked_rows += rows
            self.agreed_rows += agreed
            self._recent.extend(outcomes)
            window = self._rows.setdefault(key, deque(maxlen=self.config.window))
            window.extend(outcomes)
            changed = window.count(False) / len(window)
            if len(window) >= self.config.min_checks and changed > self.max_quality_loss:
                self.ceiling = min(self.ceiling, key - CEILING_EPS)
                for share in [share for share in self._rows if share > self.ceiling]:
                    del self._rows[share]

    def agreement(self) -> float:
        """Top-1 agreement with the full path over the last `window` checked rows (1.0: none)."""
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else 1.0

    def _share(self, budget: float | None) -> float:
        """The plan of `budget` as one number: a stored plan's budget, or (the fixed skip
        order) the prunable share its gates skip, so budgets running the same gates share
        their checks and the ceiling drops below the plan that failed."""
        plan = guard_budget(self.compiled.plans, budget, self.compiled.guard, DECODER)
        if self.compiled.plans:
            return plan.budget
        return self.compiled.skipped_share(self.compiled.gates_for_budget(plan.budget))
