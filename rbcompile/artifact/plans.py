"""Budget -> gates. `budget` in [0, 1] is the fraction of prunable FLOPs to skip.

This is the fixed skip order used until calibration measures importance: whole layers, outward
from 60% of the depth (attention branch of a layer before its MLP branch); the first and last
layers always run. Chosen by measurement on smollm2-135m (Emma, 2 x 512 tokens, perplexity 30.1
in full): at budget 0.1 this order gives 37.7, skipping attention branches from the back first
2286, whole layers from the back 5303 (snippet in the closing note of the compile-pipeline
issue).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rbcompile.artifact.regions import Plan, width_level

CENTRE = 0.6  # relative depth from which layers are skipped outward


def skip_order(regions: list[dict]) -> list[dict]:
    """Prunable regions in the order a budget skips them."""
    prunable = [r for r in regions if r["kind"] == "prunable"]
    layers = sorted({r["layer"] for r in prunable})
    if len(layers) <= 2:
        return []
    centre = layers[0] + CENTRE * (layers[-1] - layers[0])
    eligible = [r for r in prunable if r["layer"] not in (layers[0], layers[-1])]
    return sorted(eligible, key=lambda r: (abs(r["layer"] - centre), r["layer"],
                                           r["unit_kind"] == "mlp"))


BUDGET_EPS = 1e-9  # budgets and FLOP shares compare with this slack (float sums)


def within_budget(amount: float, budget: float) -> bool:
    """True when `amount` (a FLOP share, a plan's budget) does not exceed `budget`."""
    return amount <= budget + BUDGET_EPS


def check_budget(budget) -> float:
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number in [0, 1], got {budget!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"budget must be in [0, 1], got {budget!r}")
    return value


MEASURED = ("skipped_share", "quality_loss", "decoder_quality_loss", "heldout", "decoder_heldout")


@dataclass(frozen=True)
class StoredPlan:
    """A calibrated plan as the manifest stores it (`to_json` / `from_json`): the `budget` it
    serves, the gates it skips, the widths it narrows ((gate, ratio) pairs), and what
    calibration measured on held-out text (None: unmeasured): the share of prunable FLOPs it
    skips, its quality loss on the whole-sequence graph (`quality_loss`) and on the KV-cached
    decoder (`decoder_quality_loss`), the held-out measures behind them, and the decoder's
    loss with its weights at each lower precision (`precision_losses`, (level, loss) pairs:
    skipping and precision together, against the fp32 full path)."""
    budget: float
    skip_gates: tuple[int, ...] = ()
    widths: tuple[tuple[int, float], ...] = ()
    skipped_share: float | None = None
    quality_loss: float | None = None
    decoder_quality_loss: float | None = None
    heldout: dict | None = None
    decoder_heldout: dict | None = None
    precision_losses: tuple[tuple[str, float], ...] = ()

    def plan(self, num_gates: int) -> Plan:
        """What a forward under this plan runs (widths None when it narrows nothing)."""
        gates = [True] * num_gates
        for gate in self.skip_gates:
            gates[gate] = False
        widths = None
        if self.widths:
            widths = [1.0] * num_gates
            for gate, ratio in self.widths:
                widths[gate] = ratio
        return Plan(gates, widths)

    def loss(self, path: str) -> float | None:
        """The measured quality loss on `path` (guard.FORWARD or guard.DECODER, the names of
        the two fields, or guard.decoder_path(level): the decoder at a lower weight precision);
        the full path (budget 0) costs 0 (a weight level's own loss is guarded on its own:
        executors.check_precision)."""
        if self.budget == 0:
            return 0.0
        field, _, level = path.partition("@")
        return dict(self.precision_losses).get(level) if level else getattr(self, field)

    def to_json(self) -> dict:
        stored = {"budget": self.budget, "skip_gates": list(self.skip_gates),
                  "widths": {str(gate): ratio for gate, ratio in self.widths},
                  **{name: getattr(self, name) for name in MEASURED
                     if getattr(self, name) is not None}}
        if self.precision_losses:
            stored["precision_losses"] = dict(self.precision_losses)
        return stored

    @classmethod
    def from_json(cls, stored: dict) -> "StoredPlan":
        """From the manifest's dict (checked by manifest.validate)."""
        return cls(stored["budget"], tuple(stored.get("skip_gates", ())),
                   tuple((int(gate), ratio) for gate, ratio in (stored.get("widths") or {}).items()),
                   **{name: stored.get(name) for name in MEASURED},
                   precision_losses=tuple(sorted((stored.get("precision_losses") or {}).items())))


def stored_plans(manifest: dict) -> list[StoredPlan] | None:
    """The manifest's calibrated plans (None: an uncalibrated artifact)."""
    plans = manifest.get("plans")
    return [StoredPlan.from_json(plan) for plan in plans] if plans else None


def plan_for_budget(regions: list[dict], budget: float,
                    plans: list[StoredPlan] | None = None) -> Plan:
    """The `Plan` of a budget: the calibrated plan with the largest budget <= `budget`
    when plans exist, otherwise regions skipped in `skip_order` while skipped FLOPs stay <=
    budget."""
    budget = check_budget(budget)
    num_gates = sum(1 for r in regions if r["kind"] == "prunable")
    if plans:
        plan = max((p for p in plans if within_budget(p.budget, budget)), key=lambda p: p.budget)
        return plan.plan(num_gates)
    gates = [True] * num_gates
    skipped = 0.0
    for region in skip_order(regions):
        if within_budget(skipped + region["prunable_share"], budget):
            gates[region["gate"]] = False
            skipped += region["prunable_share"]
    return Plan(gates)


def width_shares(variants: list[dict]) -> dict[int, dict[float, float]]:
    """region id -> {width ratio: prunable FLOPs share at that width} from the IR's variants."""
    shares: dict[int, dict[float, float]] = {}
    for variant in variants:
        for region_id, spec in variant["regions"].items():
            shares.setdefault(int(region_id), {})[variant["ratio"]] = spec["prunable_share"]
    return shares


def skipped_share(regions: list[dict], gates: list[bool], widths=None, shares=None) -> float:
    """Fraction of prunable FLOPs a gate / width setting does not compute."""
    total = 0.0
    for region in regions:
        if region["kind"] != "prunable":
            continue
        gate = region["gate"]
        if not gates[gate]:
            total += region["prunable_share"]
        elif widths is not None and shares and region["id"] in shares:
            level = width_level(shares[region["id"]], widths[gate])
            if level is not None:
                total += region["prunable_share"] - shares[region["id"]][level]
    return total
