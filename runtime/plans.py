"""Budget -> gates. `budget` in [0, 1] is the fraction of prunable FLOPs to skip.

This is the fixed skip order used before calibration exists: layers are skipped from the
second-to-last towards the second (first and last layers always run: they matter most in every
layer-drop study), attention branches of a layer before its MLP branch (attention in deep layers
is the most redundant, "What Matters in Transformers? Not All Attention is Needed", He et al. 2024).
"""
from __future__ import annotations

import math

_KIND_ORDER = {"attention": 0, "mlp": 1, "layer": 0}


def skip_order(regions: list[dict]) -> list[dict]:
    """Prunable regions in the order a budget skips them."""
    prunable = [r for r in regions if r["kind"] == "prunable"]
    layers = sorted({r["layer"] for r in prunable})
    if len(layers) <= 2:
        return []
    eligible = [r for r in prunable if r["layer"] not in (layers[0], layers[-1])]
    return sorted(eligible, key=lambda r: (_KIND_ORDER[r["unit_kind"]], -r["layer"]))


def check_budget(budget) -> float:
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number in [0, 1], got {budget!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"budget must be in [0, 1], got {budget!r}")
    return value


def gates_for_budget(regions: list[dict], budget: float) -> list[bool]:
    """Gates that skip regions in `skip_order` while skipped FLOPs stay <= budget."""
    budget = check_budget(budget)
    gates = [True] * sum(1 for r in regions if r["kind"] == "prunable")
    skipped = 0.0
    for region in skip_order(regions):
        if skipped + region["prunable_share"] <= budget + 1e-9:
            gates[region["gate"]] = False
            skipped += region["prunable_share"]
    return gates


def skipped_share(regions: list[dict], gates: list[bool]) -> float:
    return sum(r["prunable_share"] for r in regions if r["kind"] == "prunable" and not gates[r["gate"]])
