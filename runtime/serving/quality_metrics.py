"""Prometheus metrics of the quality loop (runtime/control/quality_loop.py), read at each scrape."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class QualityCollector:
    """The guard, the live ceiling, the withheld decisions by reason, the sampled agreement
    checks and the confidence of emitted tokens of one `DecodeController`."""

    def __init__(self, controller):
        self.controller = controller

    def collect(self):
        loop, confidence = self.controller.quality_loop, self.controller.quality.snapshot()
        yield _gauge("rbcompile_quality_guard_max_loss", "The most quality loss a lossy plan "
                     "may cost (measured on held-out text; +Inf: no guard)", loop.max_quality_loss)
        yield _gauge("rbcompile_quality_ceiling_budget", "The largest budget that runs as asked "
                     "under the guard and the live agreement checks", loop.ceiling_budget())
        withheld = CounterMetricFamily(
            "rbcompile_lossy_plans_withheld", "Controller decisions that asked for a plan the "
            "quality loop withheld: over_guard (measured loss over the guard), unmeasured (never "
            "measured, not allowed), observed (live agreement below the guard)", labels=["reason"])
        for reason, count in sorted(loop.withheld.items()):
            withheld.add_metric([reason], count)
        yield withheld
        yield CounterMetricFamily("rbcompile_quality_checked_rows", "Rows of light decode steps "
                                  "also run on the full path", value=loop.checked_rows)
        yield CounterMetricFamily("rbcompile_quality_agreed_rows", "Of those, rows whose top-1 "
                                  "token the light plan kept", value=loop.agreed_rows)
        yield _gauge("rbcompile_quality_sampled_agreement", "Top-1 agreement with the full path "
                     "over the last checked rows (1 before any)", loop.agreement())
        yield _gauge("rbcompile_token_confidence_mean", "Mean top-1 probability of recently "
                     "emitted tokens", confidence["mean"])


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
