"""Calibration: measure what each prunable region is worth, then choose a plan per budget.

Per region: Block Influence (ShortGPT: 1 - cosine of the residual stream entering and leaving
it, averaged over real tokens) and the measured loss increase when that region alone is skipped.
Plans: for each budget of the grid, regions are skipped greedily in order of measured loss
increase per prunable FLOP saved while the skipped share stays within the budget; each plan is
then verified on held-out calibration text and stored with its measured quality.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import quality
from .calibration_data import Batches
from .codegen import method_name
from .progress import say

BUDGET_GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


@contextmanager
def capture_streams(compiled):
    """Record (stream in, stream out) of every prunable region while the block runs."""
    module = compiled.module
    records: dict[int, list] = {}
    wrapped = []
    for region in compiled.regions:
        if region["kind"] != "prunable":
            continue
        method = getattr(module, method_name(region))
        (_, stream_in), = region["skip"].items()
        position = region["inputs"].index(stream_in)

        def wrapper(*args, _method=method, _pos=position, _id=region["id"]):
            out = _method(*args)
            records.setdefault(_id, []).append((args[_pos], out))
            return out
        module.__dict__[method_name(region)] = wrapper
        wrapped.append(method_name(region))
    try:
        yield records
    finally:
        for name in wrapped:
            del module.__dict__[name]


def region_method(region: dict) -> str:
    from .codegen import _method_name
    return _method_name(region)


def _influence(pairs, masks) -> float:
    """Mean over real tokens of 1 - cos(stream in, stream out)."""
    total, count = 0.0, 0
    for (stream_in, stream_out), mask in zip(pairs, masks):
        cos = F.cosine_similarity(stream_in.float(), stream_out.float(), dim=-1)
        real = mask.bool()
        total += (1 - cos)[real].sum().item()
        count += int(real.sum())
    return total / max(count, 1)


class Evaluator:
    """Runs gate settings over a fixed set of batches and reports quality vs the full path."""

    def __init__(self, compiled, batches):
        self.compiled = compiled
        self.batches = batches
        self.family = compiled.family
        self.references = [quality.reference(self.family, compiled(ids, mask), mask)
                           for ids, mask in batches]

    def __call__(self, gates) -> dict:
        parts = [quality.measure(self.family, self.compiled(ids, mask, gates=gates), ids, mask, ref)
                 for (ids, mask), ref in zip(self.batches, self.references)]
        return quality.summarise(self.family, parts)


def layer_influence(compiled, records, masks) -> dict[int, float]:
    """Block Influence of whole layers: stream entering the first region, leaving the last."""
    by_layer: dict[int, list[dict]] = {}
    for region in compiled.regions:
        if region["kind"] == "prunable":
            by_layer.setdefault(region["layer"], []).append(region)
    out = {}
    for layer, regions in by_layer.items():
        first, last = records[regions[0]["id"]], records[regions[-1]["id"]]
        pairs = [(a[0], b[1]) for a, b in zip(first, last)]
        out[layer] = _influence(pairs, masks)
    return out


def measure_importance(compiled, batches: Batches) -> dict:
    """Block Influence and skip-alone loss increase of every prunable region."""
    calib = Evaluator(compiled, batches.calibration)
    prunable = [r for r in compiled.regions if r["kind"] == "prunable"]
    full_gates = [True] * compiled.num_gates
    masks = [mask for _, mask in batches.calibration]
    with capture_streams(compiled) as records:
        base = calib(full_gates)
    influence = {r["id"]: _influence(records[r["id"]], masks) for r in prunable}
    layers = layer_influence(compiled, records, masks)
    del records
    regions = {}
    for index, region in enumerate(prunable, 1):
        gates = list(full_gates)
        gates[region["gate"]] = False
        measured = calib(gates)
        regions[str(region["id"])] = {"block_influence": influence[region["id"]],
                                      "loss_increase": measured["loss"] - base["loss"]}
        say(f"  calibration {index}/{len(prunable)}: {region['name']}: loss "
            f"{measured['loss'] - base['loss']:+.4f}, BI {influence[region['id']]:.4f}")
    return {"base": base, "regions": regions,
            "layers": {str(k): {"block_influence": v} for k, v in layers.items()}}


def plan_order(regions: list[dict], importance: dict) -> list[dict]:
    """Prunable regions by measured loss increase per prunable FLOP share (cheapest first)."""
    prunable = [r for r in regions if r["kind"] == "prunable"]
    cost = lambda r: importance["regions"][str(r["id"])]["loss_increase"] / max(r["prunable_share"], 1e-12)  # noqa: E731
    return sorted(prunable, key=cost)


def fill_budget(order: list[dict], budget: float, num_gates: int) -> list[bool]:
    """Skip regions in `order` while the skipped prunable-FLOP share stays <= budget."""
    gates, skipped = [True] * num_gates, 0.0
    for region in order:
        if skipped + region["prunable_share"] <= budget + 1e-9:
            gates[region["gate"]] = False
            skipped += region["prunable_share"]
    return gates


def build_plans(compiled, importance: dict, batches: Batches, grid=BUDGET_GRID) -> list[dict]:
    """One verified plan per budget of the grid."""
    from .runtime.plans import skipped_share

    heldout = Evaluator(compiled, batches.heldout)
    order = plan_order(compiled.regions, importance)
    plans = []
    for budget in grid:
        gates = fill_budget(order, budget, compiled.num_gates)
        measured = heldout(gates)
        plans.append({"budget": budget, "skip_gates": [i for i, g in enumerate(gates) if not g],
                      "skipped_share": skipped_share(compiled.regions, gates), "heldout": measured})
        say(f"  plan {budget:.2f}: skips {len(plans[-1]['skip_gates'])} regions "
            f"({plans[-1]['skipped_share']:.1%}), held-out loss {measured['loss']:.4f}")
    plans.insert(0, {"budget": 0.0, "skip_gates": [], "skipped_share": 0.0,
                     "heldout": heldout([True] * compiled.num_gates)})
    return plans


def _width_loss(family: str, model, ids, mask, generator) -> torch.Tensor:
    """Decoders: next-token loss. Encoders (no task head): the pooled embedding projected on
    fixed random directions, so |A^T dL/dA| measures how much a head or channel moves it."""
    if family == "decoder":
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        weight = (mask[:, 1:] * mask[:, :-1]).bool()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                               reduction="none").view_as(weight)
        return loss[weight].mean()
    pooled = quality.mean_pool(model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    directions = torch.randn(pooled.shape, generator=generator)
    return (pooled * directions).sum()


def measure_width_importance(model, units, family: str, batches) -> dict[str, dict[str, list[float]]]:
    """Per attention head: E|A_h^T dL/dA_h| (Michel et al. 2019), A_h = the head's slice of the
    output projection's input; per MLP channel: E|a_c dL/da_c| (first-order Taylor). Summed per
    sample over positions, averaged over samples, L2-normalised per layer."""
    modules = dict(model.named_modules())
    targets = {}
    for unit in units:
        for key, part in (("attention_out", "heads"), ("mlp_out", "channels")):
            if key in unit.width:
                targets[unit.width[key]] = (unit, part)
    captured: dict[str, torch.Tensor] = {}
    hooks = [modules[path].register_forward_pre_hook(
        lambda module, args, _path=path: captured.__setitem__(_path, args[0]))
        for path in targets]
    sums = {path: 0.0 for path in targets}
    generator = torch.Generator().manual_seed(0)
    grad_flags = [p.requires_grad for p in model.parameters()]
    try:
        for param in model.parameters():
            param.requires_grad_(True)
        for ids, mask in batches:
            with torch.enable_grad():
                loss = _width_loss(family, model, ids, mask, generator)
                paths = list(captured)
                grads = torch.autograd.grad(loss, [captured[p] for p in paths])
            for path, grad in zip(paths, grads):
                unit, part = targets[path]
                contribution = (captured[path].detach() * grad) * mask.unsqueeze(-1)
                per_sample = contribution.sum(1)  # [batch, features]
                if part == "heads":
                    per_sample = per_sample.view(len(ids), unit.width["heads"], -1).sum(-1)
                sums[path] = sums[path] + per_sample.abs().sum(0)
            captured.clear()
    finally:
        for hook in hooks:
            hook.remove()
        for param, flag in zip(model.parameters(), grad_flags):
            param.requires_grad_(flag)
    scores: dict[str, dict[str, list[float]]] = {}
    for path, total in sums.items():
        unit, part = targets[path]
        normalised = total / total.norm().clamp(min=1e-12)
        scores.setdefault(unit.name, {})[part] = normalised.tolist()
    return scores
