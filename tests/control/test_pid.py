"""PID step response, no oscillation, anti-windup, in a simulated plant."""
import math

import pytest

from rbcompile.runtime.control.pid import PIDConfig, PIDController


def _plant(base_latency: float):
    """Latency falls linearly with the budget (80% of the work is prunable)."""
    return lambda budget: base_latency * (1 - 0.8 * budget)


def _run(controller, plant_at, periods):
    budget, trace = controller.output, []
    for k in range(periods):
        latency = plant_at(k)(budget)
        budget = controller.update(latency)
        trace.append((latency, budget))
    return trace


def test_settles_within_three_periods_after_a_load_step_without_oscillating():
    slo = 0.100
    controller = PIDController(PIDConfig(setpoint=slo))
    # night: the full model meets the SLO; day (from period 10): traffic makes it 1.6x slower
    trace = _run(controller, lambda k: _plant(0.08 if k < 10 else 0.16), 30)
    assert all(b == 0 for _, b in trace[:10])
    after = [lat for lat, _ in trace[10:]]
    settled = [abs(lat - slo) / slo <= 0.05 for lat in after]
    assert all(settled[2:]), [round(x, 4) for x in after[:8]]  # 3rd period after the step on
    errors = [lat - slo for lat in after[1:]]
    sign_changes = sum(1 for x, y in zip(errors, errors[1:]) if x * y < 0 and abs(y) > 0.01 * slo)
    assert sign_changes <= 1


def test_anti_windup_recovers_quickly_after_saturation():
    controller = PIDController(PIDConfig(setpoint=0.1))
    for _ in range(50):  # impossible SLO: output pinned at the top
        assert controller.update(0.5) <= 1.0
    assert controller.output == 1.0
    integral_at_clamp = controller.integral
    assert integral_at_clamp < 10  # did not keep growing while clamped
    trace = _run(controller, lambda k: _plant(0.08), 6)
    assert trace[-1][1] < 0.2  # unwinds within a few periods once the load drops


def test_quality_floor_lowers_the_budget_when_quality_drops():
    controller = PIDController(PIDConfig(setpoint=0.9, initial=0.5))
    assert controller.update(0.8) < 0.5
    controller.reset()
    assert controller.update(0.95) > 0.5


def test_defaults_and_bad_config():
    assert PIDConfig(setpoint=1.0).a == 0.4
    cfg = PIDConfig(setpoint=1.0, a=0.9)
    assert math.isclose(cfg.b, 0.3) and math.isclose(cfg.c, 0.18)
    for bad in (dict(setpoint=0), dict(setpoint=float("nan")),
                dict(setpoint=1, initial=2)):
        with pytest.raises(ValueError):
            PIDConfig(**bad)
    controller = PIDController(PIDConfig(setpoint=1.0))
    assert controller.update(float("nan")) == controller.output


def test_a_huge_error_moves_the_output_no_more_than_the_error_limit_allows():
    controller = PIDController(PIDConfig(setpoint=0.1, output_max=2.0))
    first = controller.update(1.0)          # 10x the SLO: relative error 9, clipped to 1
    cfg = controller.config
    assert first == pytest.approx(cfg.a + cfg.b)
    with pytest.raises(ValueError, match="error_limit"):
        PIDConfig(setpoint=0.1, error_limit=0)
