"""The adaptive controller inside `rbcompile serve`: a policy sets the budget of the serving
engine's decode steps from what the monitors see.

Before an engine step (on the model thread), at most once per `period_s`, `DecodeController`
builds a `PolicyState`: decode-step latency (the SLO is per step, the inter-token latency every
running stream feels) p50 / p99 over the last seconds, the queue, arrivals per second, system
memory, CPU, and the confidence (top-1 probability) of recently emitted tokens. The policy
(static, PID on the latency SLO, a PPO-trained one) decides: that is the resource loop. The
quality loop (runtime/control/quality_loop.py) bounds it: the decided budget, clamped to what the
quality guard and the live agreement checks allow, becomes `engine.budget`, under which every
request that brings no budget of its own runs. The same policies drive the in-process
`AdaptiveServer`.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import psutil

from rbcompile.runtime.control.monitors import LatencyTracker, QualityMonitor
from rbcompile.runtime.control.policy import BasePolicy, Decision, PolicyState
from rbcompile.runtime.control.quality_loop import QualityLoop

LATENCY_WINDOW_S = 5.0


class DecodeController:
    """Drives `engine.budget` with `policy`; `memory()` gives the system memory fraction,
    `cpu()` the CPU utilisation (psutil's since the last call by default) and `clock()` the time
    in seconds (the decode-step simulator, runtime/control/decode_simulator.py, passes its own).
    `quality_loop` clamps each decided budget (None: the decision runs as it is, for a
    simulator whose table holds only the plans it may run); a decided weight level (the
    policy's `levels`, levers.precision_ladder: within the guard) becomes `engine.weights`."""

    def __init__(self, engine, policy: BasePolicy, slo_s: float, memory: Callable[[], float],
                 period_s: float = 0.25, *, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] | None = None, quality_loop: QualityLoop | None = None):
        if not slo_s > 0 or period_s < 0:
            raise ValueError("slo_s must be > 0 and period_s >= 0")
        self.engine, self.policy, self.slo_s, self.memory = engine, policy, slo_s, memory
        self.period_s, self.clock, self.quality_loop = period_s, clock, quality_loop
        self.cpu = cpu or (lambda: psutil.cpu_percent(None) / 100)
        self.steps = LatencyTracker(latency_window_s=LATENCY_WINDOW_S, clock=clock)
        self.quality = QualityMonitor()
        self.decision = Decision()
        self.last_step_s = 0.0
        self._decided_at: float | None = None
        engine.controller = self

    def arrived(self) -> None:
        """A request was submitted (any thread)."""
        self.steps.record_arrival()

    def step_done(self, seconds: float, confidences: list[float]) -> None:
        """A decode step took `seconds`; its rows' chosen tokens had these probabilities."""
        self.last_step_s = seconds
        self.steps.record(seconds)
        self.quality.record(confidences)

    def before_step(self) -> None:
        now = self.clock()
        if self._decided_at is not None and now - self._decided_at < self.period_s:
            return
        self._decided_at = now
        state = self.state()
        self.policy.observe(state)
        self.decision = self.policy.decide(state)
        budget = self.decision.budget or None
        self.engine.budget = self.quality_loop.clamp(budget) if self.quality_loop else budget
        if self.decision.weights is not None:
            self.engine.levels.check(self.decision.weights)
        self.engine.weights = self.decision.weights

    def bound(self, budget: float | None) -> float | None:
        """The budget a request's own `budget` runs under the quality loop."""
        return self.quality_loop.bound(budget) if self.quality_loop else budget

    def prefill_budget(self, budget: float | None) -> float | None:
        """The budget a prefill of `budget` runs under the quality loop."""
        return self.quality_loop.prefill_budget(budget) if self.quality_loop else budget

    def check_due(self, budget: float | None) -> bool:
        """Whether the engine checks this light decode step against the full path."""
        return self.quality_loop is not None and self.quality_loop.check_due(budget)

    def checked(self, budget: float | None, agreed: int, rows: int) -> None:
        """A checked light step: `agreed` of `rows` kept the full path's top-1 token."""
        self.quality_loop.checked(budget, agreed, rows)

    def state(self) -> PolicyState:
        latency, quality, engine = self.steps.snapshot(), self.quality.snapshot(), self.engine
        lengths = [len(request.prompt) + len(request.tokens) for request in engine.running]
        finite = lambda value: value if math.isfinite(value) else 0.0  # noqa: E731
        return PolicyState(
            memory=self.memory(), input_length=sum(lengths) / len(lengths) if lengths else 0.0,
            queue_depth=engine.queued, arrival_rate=latency["arrival_rate"],
            last_latency=self.last_step_s, latency_p50=finite(latency["p50"]),
            latency_p99=finite(latency["p99"]), confidence_mean=quality["mean"],
            confidence_p10=quality["p10"], cpu_utilisation=self.cpu(),
            previous_budget=self.decision.budget, slo_s=self.slo_s,
            max_length=engine.shape.max_positions)
