"""Policies: what the runtime asks before each batch. One interface, `BasePolicy`; users subclass it.

A policy sees a `PolicyState` (about 12 features of memory, load, latency and output confidence)
and returns a `Decision` (budget, head-width ratio, result-cache use). Built in: `StaticPolicy`
(open loop), `PIDPolicy` (closed loop on a latency SLO or a quality floor) and the PPO policy
(runtime/control/ppo.py). `GuardedPolicy` bounds the time a decision may take and falls back to a
default policy when it is exceeded.
"""
from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import math
import threading
import time
from dataclasses import dataclass

from rbcompile.artifact.plans import check_budget
from rbcompile.runtime.control.pid import PIDConfig, PIDController

FEATURES = ("memory", "input_length", "complexity", "queue_depth", "arrival_rate",
            "last_latency", "latency_p50", "latency_p99", "confidence_mean", "confidence_p10",
            "cpu_utilisation", "previous_budget")


@dataclass
class PolicyState:
    """What a policy sees. Raw units; `vector()` gives the normalised features."""
    memory: float = 0.0            # system memory in use, fraction [0, 1]
    input_length: float = 0.0      # mean real tokens per request of the next batch
    complexity: float = 0.0        # mean complexity score of the next batch [0, 1]
    queue_depth: int = 0           # requests waiting
    arrival_rate: float = 0.0      # requests / s over the last second
    last_latency: float = 0.0      # seconds, last batch (queueing included)
    latency_p50: float = 0.0       # seconds, recent requests
    latency_p99: float = 0.0
    confidence_mean: float = 1.0   # output confidence of recent requests [0, 1]
    confidence_p10: float = 1.0
    cpu_utilisation: float = 0.0   # fraction [0, 1]
    previous_budget: float = 0.0
    slo_s: float = 0.1             # latency objective used to normalise latencies
    max_length: int = 512          # used to normalise input_length
    max_queue: int = 256           # used to normalise queue_depth and arrival_rate

    def vector(self) -> list[float]:
        """The 12 features in `FEATURES` order, each roughly in [0, 1] (latencies / SLO may
        exceed 1; they are capped at 4)."""
        q = math.log1p(self.max_queue)
        return [self.memory, min(1.0, self.input_length / self.max_length), self.complexity,
                min(1.0, math.log1p(self.queue_depth) / q),
                min(1.0, math.log1p(self.arrival_rate) / q),
                min(4.0, self.last_latency / self.slo_s), min(4.0, self.latency_p50 / self.slo_s),
                min(4.0, self.latency_p99 / self.slo_s), self.confidence_mean,
                self.confidence_p10, self.cpu_utilisation, self.previous_budget]


@dataclass(frozen=True)
class Decision:
    budget: float = 0.0        # fraction of prunable FLOPs to skip (light tier; see Tiers)
    width: float = 1.0         # head / channel width ratio cap; 1.0 = what the plan says
    use_cache: bool = True     # serve exact repeats from the result cache
    tier_shift: float = 0.0    # move the tier thresholds this share of the way to 1 (Tiers.shifted)
    weights: str | None = None  # decode steps' weight level (None: the decoder's; levers.py)

    def __post_init__(self):
        check_budget(self.budget)
        if not (isinstance(self.width, (int, float)) and 0 < self.width <= 1):
            raise ValueError(f"width must be in (0, 1], got {self.width!r}")
        if not (isinstance(self.tier_shift, (int, float)) and 0 <= self.tier_shift <= 1):
            raise ValueError(f"tier_shift must be in [0, 1], got {self.tier_shift!r}")


class BasePolicy(abc.ABC):
    """Subclass and implement `decide`. `observe` is called after each batch (optional)."""
    name = "base"

    @abc.abstractmethod
    def decide(self, state: PolicyState) -> Decision:
        ...

    def observe(self, state: PolicyState) -> None:  # noqa: B027 - optional hook
        """Feedback after a batch (closed-loop policies update here)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget state between runs."""


class StaticPolicy(BasePolicy):
    """Open loop: always the same decision."""
    name = "static"

    def __init__(self, budget: float = 0.0, width: float = 1.0, use_cache: bool = True,
                 tier_shift: float = 0.0):
        self.decision = Decision(budget, width, use_cache, tier_shift)

    def decide(self, state: PolicyState) -> Decision:
        return self.decision


class PIDPolicy(BasePolicy):
    """Closed loop: a PID controller moves the budget to hold the p99 latency at the SLO
    (`target="latency"`) or the mean output confidence at a floor (`target="quality"`).
    It updates once per control period (`config.period_s`; 0: on every observation).

    With `max_tier_shift > 0` the controller's range goes on past the largest budget: output
    u gives budget min(u, max_budget) and tier shift u - max_budget beyond it, so under
    sustained overload the tier thresholds rise and more requests take the light tiers.

    `levels` (levers.precision_ladder) come first: the output's first len(levels) units move
    decode steps down the weight levels (level i from u >= i + 0.5), and the budget starts
    beyond them, so the controller lowers precision before it skips."""
    name = "pid"

    def __init__(self, config: PIDConfig, target: str = "latency", max_budget: float = 1.0,
                 max_tier_shift: float = 0.0, levels: tuple[str, ...] = ()):
        if target not in ("latency", "quality"):
            raise ValueError(f"target must be 'latency' or 'quality', got {target!r}")
        if not 0 <= max_tier_shift <= 1:
            raise ValueError(f"max_tier_shift must be in [0, 1], got {max_tier_shift!r}")
        self.max_budget, self.levels = min(config.output_max, max_budget), tuple(levels)
        # a copy: the caller's config is not changed
        config = dataclasses.replace(
            config, output_max=len(self.levels) + self.max_budget + max_tier_shift)
        self.controller = PIDController(config)
        self.target = target
        self._last_update: float | None = None

    def observe(self, state: PolicyState) -> None:
        now = time.monotonic()
        period = self.controller.config.period_s
        if self._last_update is not None and now - self._last_update < period:
            return
        elapsed = 1.0 if self._last_update is None or period <= 0 else \
            (now - self._last_update) / period
        self._last_update = now
        measured = state.latency_p99 if self.target == "latency" else state.confidence_mean
        self.controller.update(measured, dt_periods=min(elapsed, 4.0))

    def decide(self, state: PolicyState) -> Decision:
        rung = min(len(self.levels), math.floor(self.controller.output + 0.5))
        output = max(0.0, self.controller.output - len(self.levels))
        return Decision(budget=min(output, self.max_budget),
                        tier_shift=min(1.0, max(0.0, output - self.max_budget)),
                        weights=self.levels[rung - 1] if rung else None)

    def reset(self) -> None:
        self.controller.reset()
        self._last_update = None


class GuardedPolicy(BasePolicy):
    """Runs `policy.decide` with a deadline (5 ms default). A late or failing decision is replaced
    by `fallback.decide` and counted in `fallbacks`; while a late call is still running, further
    decisions fall back at once (one worker thread, never a pile of them)."""

    def __init__(self, policy: BasePolicy, fallback: BasePolicy, deadline_s: float = 0.005):
        self.policy = policy
        self.fallback = fallback
        self.deadline_s = deadline_s
        self.name = policy.name
        self.fallbacks = 0
        self.decisions = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix="rb-policy")
        self._pending: concurrent.futures.Future | None = None
        self._lock = threading.Lock()

    def decide(self, state: PolicyState) -> Decision:
        with self._lock:
            self.decisions += 1
            if self._pending is not None and not self._pending.done():
                self.fallbacks += 1
                return self.fallback.decide(state)
            self._pending = self._pool.submit(self.policy.decide, state)
            try:
                decision = self._pending.result(timeout=self.deadline_s)
                if not isinstance(decision, Decision):
                    raise TypeError(f"{type(self.policy).__name__}.decide returned "
                                    f"{type(decision).__name__}, not Decision")
                return decision
            except Exception:  # late, failed or malformed: the default policy decides
                self.fallbacks += 1
                return self.fallback.decide(state)

    def observe(self, state: PolicyState) -> None:
        self.policy.observe(state)
        self.fallback.observe(state)

    def reset(self) -> None:
        self.policy.reset()
        self.fallback.reset()
        self.fallbacks = self.decisions = 0
