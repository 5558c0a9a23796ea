"""Policies: one interface; a slow or broken policy falls back to the default within 5 ms."""
import math
import time

import pytest

from rbcompile.runtime.control.pid import PIDConfig
from rbcompile.runtime.control.policy import (
    FEATURES,
    BasePolicy,
    Decision,
    GuardedPolicy,
    PIDPolicy,
    PolicyState,
    StaticPolicy,
)


class SlowPolicy(BasePolicy):
    def decide(self, state):
        time.sleep(0.05)
        return Decision(0.3)


class BrokenPolicy(BasePolicy):
    def decide(self, state):
        return "budget 0.3"


def test_state_vector_has_the_named_features_normalised():
    state = PolicyState(memory=0.5, input_length=256, queue_depth=256, latency_p99=0.2, slo_s=0.1,
                        max_length=512, max_queue=256)
    vector = state.vector()
    assert len(vector) == len(FEATURES) == 12
    assert vector[FEATURES.index("input_length")] == 0.5
    assert vector[FEATURES.index("queue_depth")] == pytest.approx(1.0)
    assert vector[FEATURES.index("latency_p99")] == pytest.approx(2.0)


def test_slow_policy_falls_back_within_the_deadline_and_is_counted():
    guarded = GuardedPolicy(SlowPolicy(), StaticPolicy(0.1), deadline_s=0.005)
    start = time.perf_counter()
    decisions = [guarded.decide(PolicyState()) for _ in range(5)]
    elapsed = time.perf_counter() - start
    assert all(d.budget == 0.1 for d in decisions)
    assert guarded.fallbacks == guarded.decisions == 5
    assert elapsed < 5 * 0.05  # nobody waited for the slow policy
    fast = GuardedPolicy(StaticPolicy(0.2), StaticPolicy(0.1))
    assert fast.decide(PolicyState()).budget == 0.2 and fast.fallbacks == 0
    broken = GuardedPolicy(BrokenPolicy(), StaticPolicy(0.1))
    assert broken.decide(PolicyState()).budget == 0.1 and broken.fallbacks == 1


def test_pid_policy_raises_the_budget_when_p99_exceeds_the_slo_and_lowers_it_after():
    policy = PIDPolicy(PIDConfig(setpoint=0.1, period_s=0.0))
    for _ in range(5):
        policy.observe(PolicyState(latency_p99=0.2))
    high = policy.decide(PolicyState()).budget
    assert high > 0.3
    for _ in range(20):
        policy.observe(PolicyState(latency_p99=0.05))
    assert policy.decide(PolicyState()).budget < high
    quality = PIDPolicy(PIDConfig(setpoint=0.8, period_s=0.0, initial=0.5), target="quality")
    quality.observe(PolicyState(confidence_mean=0.6))  # below the floor: spend more compute
    assert quality.decide(PolicyState()).budget < 0.5


def test_bad_decisions_and_targets_are_rejected():
    with pytest.raises(ValueError, match="budget"):
        Decision(budget=math.nan)
    with pytest.raises(ValueError, match="width"):
        Decision(width=0)
    with pytest.raises(ValueError, match="target"):
        PIDPolicy(PIDConfig(setpoint=0.1), target="throughput")


def test_pid_goes_past_the_largest_budget_into_tier_shift_and_back():
    policy = PIDPolicy(PIDConfig(setpoint=0.1, period_s=0.0), max_budget=0.4, max_tier_shift=0.5)
    decisions = []
    for _ in range(30):  # sustained overload: 4x the SLO
        policy.observe(PolicyState(latency_p99=0.4))
        decisions.append(policy.decide(PolicyState()))
    assert max(d.budget for d in decisions) == pytest.approx(0.4)
    assert all(d.tier_shift == 0 for d in decisions if d.budget < 0.4)  # budget first
    assert decisions[-1].tier_shift == pytest.approx(0.5)
    for _ in range(30):
        policy.observe(PolicyState(latency_p99=0.02))
    assert policy.decide(PolicyState()).tier_shift == 0
    assert PIDPolicy(PIDConfig(setpoint=0.1, period_s=0.0)).controller.config.output_max == 1.0
    with pytest.raises(ValueError, match="max_tier_shift"):
        PIDPolicy(PIDConfig(setpoint=0.1), max_tier_shift=1.5)
    with pytest.raises(ValueError, match="tier_shift"):
        Decision(tier_shift=-0.1)


def test_pid_policy_leaves_its_callers_config_alone():
    config = PIDConfig(setpoint=0.15)
    policy = PIDPolicy(config, max_budget=0.5, max_tier_shift=1.0)
    assert config.output_max == PIDConfig(setpoint=0.15).output_max
    assert policy.controller.config.output_max == 1.5
