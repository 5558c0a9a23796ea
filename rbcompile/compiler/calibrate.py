"""Calibration: measure what each prunable region is worth, then choose a plan per budget.

Per region: Block Influence (ShortGPT: 1 - cosine of the residual stream entering and leaving
it, averaged over real tokens) and the measured loss increase when that region alone is skipped
or, for each width level, narrowed. Plans: each region moves through its states (full, narrower
widths, skipped); a greedy search takes, step by step, the move with the lowest loss increase
per prunable FLOP saved, measured in the context of the moves already taken (see
`greedy_trajectory`). Each budget's plan is then verified on held-out calibration text and
stored with its measured quality.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from rbcompile.artifact import quality
from rbcompile.artifact.plans import StoredPlan, within_budget
from rbcompile.progress import say

BUDGET_GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


@contextmanager
def capture_streams(compiled):
    """Record (stream in, stream out) of every prunable region while the block runs (each
    region through its own method: seams are off meanwhile)."""
    module = compiled.module
    records: dict[int, list] = {}
    wrapped = []
    seams, module.fuse_seams = getattr(module, "fuse_seams", True), False
    for region in module.REGIONS:
        if region.kind != "prunable":
            continue
        method = getattr(module, region.method)
        position = region.inputs.index(region.skip[1])

        def wrapper(*args, _method=method, _pos=position, _id=region.id):
            out = _method(*args)
            records.setdefault(_id, []).append((args[_pos], out))
            return out
        module.__dict__[region.method] = wrapper
        wrapped.append(region.method)
    try:
        yield records
    finally:
        module.fuse_seams = seams
        for name in wrapped:
            del module.__dict__[name]


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
    """Runs gate settings over a fixed set of batches and reports quality vs the full path
    (or, with a task head and labels, the task loss and accuracy)."""

    def __init__(self, compiled, batches, labels=None, head=None):
        self.compiled = compiled
        self.batches = batches
        self.family = compiled.family
        own = compiled.task_head == "sequence-classification"  # heads.SEQUENCE
        self.task = (head is not None or own) and labels is not None
        self.labels = labels if self.task else [None] * len(batches)
        self.head = head
        self.references = [quality.reference(self.family, compiled(ids, mask), mask)
                           for ids, mask in batches]

    def __call__(self, gates, widths=None) -> dict:
        parts = [quality.measure(self.family, self.compiled(ids, mask, gates=gates, widths=widths),
                                 ids, mask, ref, labels, self.head)
                 for (ids, mask), ref, labels in zip(self.batches, self.references, self.labels)]
        return quality.summarise(self.family, parts, self.task)


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


def measure_importance(compiled, calib: Evaluator) -> dict:
    """Block Influence and skip-alone / narrow-alone loss increase of every prunable region,
    on the calibration batches of `calib`."""
    prunable = [r for r in compiled.regions if r["kind"] == "prunable"]
    full_gates = [True] * compiled.num_gates
    masks = [mask for _, mask in calib.batches]
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
        entry = {"block_influence": influence[region["id"]],
                 "loss_increase": measured["loss"] - base["loss"], "width_loss_increase": {}}
        for ratio in sorted(compiled.width_shares.get(region["id"], {}), reverse=True):
            widths = [1.0] * compiled.num_gates
            widths[region["gate"]] = ratio
            entry["width_loss_increase"][str(ratio)] = calib(full_gates, widths)["loss"] - base["loss"]
        regions[str(region["id"])] = entry
        narrowed = ", ".join(f"w{float(r):g} {v:+.4f}" for r, v in entry["width_loss_increase"].items())
        say(f"  calibration {index}/{len(prunable)}: {region['name']}: skip "
            f"{entry['loss_increase']:+.4f}{', ' + narrowed if narrowed else ''}, "
            f"BI {influence[region['id']]:.4f}")
    return {"base": base, "regions": regions,
            "layers": {str(k): {"block_influence": v} for k, v in layers.items()}}


def region_states(region: dict, importance: dict, shares: dict) -> list[tuple]:
    """(width or 0 for skipped, share saved, loss increase) from full width to skipped."""
    entry = importance["regions"][str(region["id"])]
    states = [(1.0, 0.0, 0.0)]
    for ratio in sorted(shares.get(region["id"], {}), reverse=True):
        saved = region["prunable_share"] - shares[region["id"]][ratio]
        if saved > states[-1][1]:  # a level that saves nothing more is no move
            states.append((ratio, saved, entry["width_loss_increase"][str(ratio)]))
    states.append((0.0, region["prunable_share"], entry["loss_increase"]))
    return states


def greedy_trajectory(states: dict[int, list[tuple]], evaluate, max_budget: float,
                      candidates: int = 4, report=None) -> list[tuple[float, dict[int, float]]]:
    """Greedy search over moves (one region one state further: narrower, then skipped).

    Each step ranks the feasible moves by their skip-alone loss increase per FLOP share saved
    (the prior), measures the `candidates` best of them *in the context of the moves already
    taken* with `evaluate({gate: width or 0}) -> loss`, and takes the one with the lowest
    measured loss increase per share saved. Returns the trajectory [(saved share, choice)],
    whose prefixes are the plans of growing budgets."""
    position = {gate: 0 for gate in states}
    choice: dict[int, float] = {}
    saved, loss = 0.0, evaluate({})
    trajectory = [(0.0, {})]

    def gain_and_prior(gate):
        here, nxt = states[gate][position[gate]], states[gate][position[gate] + 1]
        gain = nxt[1] - here[1]
        return gain, (nxt[2] - here[2]) / max(gain, 1e-12)
    while True:
        moves = []
        for gate in states:
            if position[gate] + 1 < len(states[gate]):
                gain, prior = gain_and_prior(gate)
                if within_budget(saved + gain, max_budget):
                    moves.append((prior, gate, gain))
        if not moves:
            return trajectory
        best = None
        for _, gate, gain in sorted(moves)[:candidates]:
            trial = {**choice, gate: states[gate][position[gate] + 1][0]}
            trial_loss = evaluate(trial)
            ratio = (trial_loss - loss) / gain
            if best is None or ratio < best[0]:
                best = (ratio, gate, gain, trial, trial_loss)
        _, gate, gain, choice, loss = best
        position[gate] += 1
        saved += gain
        trajectory.append((saved, dict(choice)))
        if report:
            report(saved, loss)


def choice_to_setting(choice: dict[int, float], num_gates: int):
    """{gate: width, 0 = skipped} -> (gates, widths or None)."""
    return StoredPlan(0.0, tuple(g for g, w in choice.items() if w == 0),
                      tuple((g, w) for g, w in choice.items() if w > 0)).plan(num_gates)


def build_plans(compiled, importance: dict, calib: Evaluator, heldout: Evaluator,
                grid=BUDGET_GRID, candidates: int = 4) -> list[StoredPlan]:
    """Plans for the budget grid from one greedy trajectory on the calibration batches, each
    verified on the held-out batches."""
    states = {r["gate"]: region_states(r, importance, compiled.width_shares)
              for r in compiled.regions if r["kind"] == "prunable"}
    steps = [0]

    def evaluate(choice):
        steps[0] += 1
        return calib(*choice_to_setting(choice, compiled.num_gates))["loss"]

    def report(saved, loss):
        say(f"  greedy search: {saved:.1%} of prunable FLOPs saved, calibration loss "
            f"{loss:.4f} ({steps[0]} settings measured)")

    trajectory = greedy_trajectory(states, evaluate, max(grid), candidates, report)
    say(f"  greedy search: {len(trajectory) - 1} moves, {steps[0]} measured settings")
    measured = MeasuredSettings(heldout)
    full = measured([True] * compiled.num_gates, None)
    plans = []
    for budget in (0.0, *grid):
        saved, choice = max((t for t in trajectory if within_budget(t[0], budget)), key=lambda t: t[0])
        gates, widths = choice_to_setting(choice, compiled.num_gates)
        heldout = measured(gates, widths)
        decoded = measured(decoder_setting(compiled, gates), None) if compiled.decoder else None
        plan = StoredPlan(budget, tuple(i for i, g in enumerate(gates) if not g),
                          tuple((g, w) for g, w in sorted(choice.items()) if w > 0),
                          skipped_share=compiled.skipped_share(gates, widths),
                          quality_loss=quality.quality_loss(heldout, full),
                          decoder_quality_loss=quality.quality_loss(decoded, full) if decoded else None,
                          heldout=heldout, decoder_heldout=decoded)
        plans.append(plan)
        decoder = f", decoder {plan.decoder_quality_loss:.3f}" if decoded else ""
        say(f"  plan {budget:.2f}: skips {len(plan.skip_gates)} regions, narrows "
            f"{len(plan.widths)} ({plan.skipped_share:.1%} of prunable FLOPs), held-out "
            f"loss {heldout['loss']:.4f}, quality loss {plan.quality_loss:.3f}{decoder}")
    return plans


class MeasuredSettings:
    """`evaluator(gates, widths)`, each distinct setting measured once."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator, self.results = evaluator, {}

    def __call__(self, gates, widths) -> dict:
        key = (tuple(gates), None if widths is None else tuple(widths))
        if key not in self.results:
            self.results[key] = self.evaluator(gates, widths)
        return self.results[key]


def decoder_setting(compiled, gates) -> list[bool]:
    """Whole-sequence gates that compute what the KV-cached decoder runs of `gates`: the
    regions it can skip (MLPs) as `gates` say, the others (attention, which writes the cache)
    on, every width full."""
    units = compiled.decoder.unit_gates
    return [bool(gates[region["gate"]]) or region["name"] not in units
            for region in sorted((r for r in compiled.regions if r["kind"] == "prunable"),
                                 key=lambda r: r["gate"])]


def _width_loss(family: str, model, ids, mask, generator, labels=None, head=None) -> torch.Tensor:
    """Decoders: next-token loss. Classifiers (their own head): cross-entropy on the labels, or
    on their own predictions without labels. Encoders: the task loss with a head and labels;
    otherwise the pooled embedding projected on fixed random directions, so |A^T dL/dA| measures how much a
    head or channel moves it."""
    if family == "decoder":
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        weight = (mask[:, 1:] * mask[:, :-1]).bool()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                               reduction="none").view_as(weight)
        return loss[weight].mean()
    out = model(input_ids=ids, attention_mask=mask)
    if getattr(out, "logits", None) is not None:  # its own classifier head
        logits = out.logits
        if labels is not None and logits.dim() == 2:
            return F.cross_entropy(logits, labels)
        targets = logits.detach().argmax(-1)  # unlabelled: its own predictions
        if logits.dim() == 3:
            real = mask.bool()
            logits, targets = logits[real], targets[real]
        return F.cross_entropy(logits, targets)
    hidden = out.last_hidden_state
    if head is not None and labels is not None:
        return F.cross_entropy(quality.head_logits(head, hidden, mask), labels)
    pooled = quality.mean_pool(hidden, mask)
    directions = torch.randn(pooled.shape, generator=generator).to(pooled.device)
    return (pooled * directions).sum()


def measure_width_importance(model, units, family: str, batches, labels=None,
                             head=None) -> dict[str, dict[str, list[float]]]:
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
        for (ids, mask), batch_labels in zip(batches, labels or [None] * len(batches)):
            with torch.enable_grad():
                loss = _width_loss(family, model, ids, mask, generator, batch_labels, head)
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
