"""PID controller that moves the budget to hold a latency SLO or a quality floor.

Each control period it moves the output by K (velocity form, so the budget holds where the
plant needs it without a standing error):

    K_k = a*e_k + b*sum(e) + c*(e_k - e_{k-1}) / dt        u_k = clamp(u_{k-1} + K_k)

Defaults follow field practice: b = a/3, c = a/5. The error is normalised by the setpoint,
`e = (measured - setpoint) / setpoint`, clipped to +-`error_limit`, and raises the budget when
positive: latency above the SLO must skip more; quality above the floor may skip more, and
quality below it must skip less.
Anti-windup: the integral does not grow while the output is clamped and the error pushes further
into the clamp, and it restarts when the error changes sign (the velocity form already holds the
output there; a stale sum would only overshoot).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PIDConfig:
    setpoint: float                 # latency SLO in seconds, or the quality floor
    a: float = 0.4                  # proportional gain (per unit of relative error)
    b: float | None = None          # integral gain, default a / 3
    c: float | None = None          # derivative gain, default a / 5
    output_min: float = 0.0
    output_max: float = 1.0
    initial: float = 0.0
    period_s: float = 0.05          # control period (50 ms default, 20 ms high-assurance)
    error_limit: float = 1.0        # |relative error| is clipped here: 10x the SLO is no
                                    # reason to jump the whole range in one period

    def __post_init__(self):
        if not (math.isfinite(self.setpoint) and self.setpoint > 0):
            raise ValueError(f"setpoint must be a positive number, got {self.setpoint!r}")
        if not self.error_limit > 0:
            raise ValueError(f"error_limit must be positive, got {self.error_limit!r}")
        if not self.output_min <= self.initial <= self.output_max:
            raise ValueError("initial output must lie within [output_min, output_max]")
        self.b = self.a / 3 if self.b is None else self.b
        self.c = self.a / 5 if self.c is None else self.c


class PIDController:
    """Call `update(measurement)` once per control period; it returns the new output."""

    def __init__(self, config: PIDConfig):
        self.config = config
        self.integral = 0.0
        self.previous_error: float | None = None
        self.output = config.initial

    def error(self, measurement: float) -> float:
        cfg = self.config
        relative = (measurement - cfg.setpoint) / cfg.setpoint
        return max(-cfg.error_limit, min(cfg.error_limit, relative))

    def update(self, measurement: float, dt_periods: float = 1.0) -> float:
        cfg = self.config
        if not math.isfinite(measurement):
            return self.output  # a missing sample changes nothing
        e = self.error(measurement)
        derivative = 0.0 if self.previous_error is None else (e - self.previous_error) / dt_periods
        if self.previous_error is not None and e * self.previous_error < 0:
            self.integral = 0.0
        candidate_integral = self.integral + e * dt_periods
        raw = self.output + cfg.a * e + cfg.b * candidate_integral + cfg.c * derivative
        clamped = min(cfg.output_max, max(cfg.output_min, raw))
        saturated_further = (raw > cfg.output_max and e > 0) or (raw < cfg.output_min and e < 0)
        if not saturated_further:
            self.integral = candidate_integral
        self.previous_error = e
        self.output = clamped
        return clamped

    def reset(self) -> None:
        self.integral, self.previous_error, self.output = 0.0, None, self.config.initial
