"""Tiered execution of one batch: probe, split by tier, run each tier as its own smaller batch.

1. Every row runs the full path up to the estimator's probe layer (encoders: the first off-ramp;
   decoders: about a tenth of the depth). Those layers always run in full.
2. The complexity score (cheap terms + the early-layer uncertainty read there) puts each row in a
   tier; each tier continues as a regrouped batch with its own plan (budget x tier scale).
3. Encoders with off-ramps: rows of the light and medium tiers may also exit early at any ramp
   they reach confidently; the full tier never exits.

Results are compact, per row: encoders give the pooled embedding (and task logits with a head),
decoders the log-probability of every real next token, the top-1 token at every real position
and the next-token prediction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rbcompile.artifact.guard import guard_budget
from rbcompile.artifact.quality import head_logits, mean_pool
from rbcompile.artifact.staged import StagedRunner
from rbcompile.runtime.control.complexity import ComplexityEstimator, Tiers
from rbcompile.runtime.control.early_exit import cascade
from rbcompile.runtime.control.policy import Decision


@dataclass
class RowResult:
    outputs: dict[str, torch.Tensor]
    tier: int
    score: float
    exit_layer: int            # -1: no early exit
    skipped: float             # fraction of prunable FLOPs not computed for this row
    confidence: float | None   # max probability of the answer (None: embeddings only)
    fallback_steps: int = 0    # tiers this row was escalated by (confidence fallback)


def pad_batch(rows, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [batch, longest] token ids (lists or 1-d tensors) and their attention mask."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.as_tensor(row)
        mask[i, :len(row)] = 1
    return ids, mask


def plan_key(decision: Decision) -> str:
    """What a cached result depends on besides the input."""
    return f"b{decision.budget:.4f}-w{decision.width:.3f}-s{decision.tier_shift:.3f}"


class TieredExecutor:
    def __init__(self, compiled, tiers: Tiers | None = None,
                 estimator: ComplexityEstimator | None = None, exit_threshold: float | None = None,
                 early_exit: bool = True):
        self.compiled = compiled
        self.tiers = tiers or Tiers()
        self.estimator = estimator or ComplexityEstimator(compiled)
        self.runner = StagedRunner(compiled)
        ramps = compiled.offramps
        self.exit_threshold = None if not early_exit or ramps is None else (
            exit_threshold if exit_threshold is not None else ramps.threshold)
        self._gate_layer = {r["gate"]: r["layer"] for r in compiled.regions if r["kind"] == "prunable"}

    def setting(self, tier: int, decision: Decision):
        """(gates, widths) of a tier under a decision, within the compiled model's quality
        guard; the width cap narrows every region (never measured: only when the guard allows
        unmeasured plans)."""
        guard = self.compiled.guard
        plan = guard_budget(self.compiled.plans, self.tiers.budget(tier, decision.budget), guard)
        gates, widths = self.compiled.plan_for_budget(plan.budget)
        if decision.width < 1 and guard.allow_unmeasured:
            widths = [min(w, decision.width) for w in (widths or [1.0] * len(gates))]
        return gates, widths

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decision: Decision,
            confidence_threshold: float | None = None, max_fallback_steps: int = 0
            ) -> list[RowResult]:
        """Per-row results. Confidence fallback: a light or medium answer below
        `confidence_threshold` is recomputed in the next higher tier that computes something
        different (at most `max_fallback_steps` times), from the probe boundary, batched with
        the rows already in that tier."""
        batch = input_ids.shape[0]
        runner, estimator = self.runner, self.estimator
        stage = runner.start(input_ids, attention_mask)
        uncertainty = None
        tiers = self.tiers.shifted(decision.tier_shift)
        probe = estimator.probe_layer if tiers.constant() is None else None
        if probe is not None:
            runner.advance(stage, [True] * self.compiled.num_gates, until_layer=probe)
            uncertainty = estimator.uncertainty(runner, stage)
        scores = estimator.score(input_ids, attention_mask, uncertainty).tolist()
        rows_of_tier: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for row, score in enumerate(scores):
            rows_of_tier[tiers.tier(score)].append(row)
        results: list[RowResult | None] = [None] * batch
        steps = [0] * batch
        plans = {tier: self.setting(tier, decision) for tier in (0, 1, 2)}
        escalate_to = self._escalation_targets(plans)
        for tier in (0, 1, 2):
            if not rows_of_tier[tier]:
                continue
            rows = torch.tensor(rows_of_tier[tier])
            if probe is not None:  # the probe stage stays intact for the tiers and retries
                sub = runner.select(stage, rows=rows)
            elif len(rows) == batch and stage.position == 0:
                sub = stage
            else:  # nothing probed: the tier's rows start as their own batch
                sub = runner.start(input_ids[rows], attention_mask[rows])
                sub.rows = rows
            for row, result in self._finish(sub, tier, plans[tier], batch, probe):
                result.score = scores[row]
                result.fallback_steps = steps[row]
                target = escalate_to[tier, result.exit_layer >= 0]
                if (confidence_threshold is not None and target is not None
                        and result.confidence is not None
                        and result.confidence < confidence_threshold
                        and steps[row] < max_fallback_steps):
                    steps[row] += 1
                    rows_of_tier[target].append(row)
                else:
                    results[row] = result
        return results

    def _exits(self, tier: int) -> bool:
        """Whether rows of `tier` may leave at an off-ramp (the full tier never does)."""
        return tier < 2 and self.exit_threshold is not None

    def _escalation_targets(self, plans: dict) -> dict[tuple[int, bool], int | None]:
        """Per (tier, whether the row exited early), the next higher tier that would compute a
        different answer: another plan (`plans`: tier -> (gates, widths)), or for an early exit
        a tier without exits. None when there is none (escalating would repeat the same work)."""
        def target(tier: int, exited: bool) -> int | None:
            return next((higher for higher in range(tier + 1, 3)
                         if plans[higher] != plans[tier] or (exited and not self._exits(higher))),
                        None)
        return {(tier, exited): target(tier, exited) for tier in (0, 1, 2) for exited in (False, True)}

    def _finish(self, stage, tier: int, plan, batch: int, probe: int | None):
        """(original row, RowResult) for a tier's regrouped stage run to the end with `plan`
        (gates, widths)."""
        runner, ramps = self.runner, self.compiled.offramps
        gates, widths = plan
        finished = []
        if self._exits(tier):
            logits = torch.empty(batch, ramps.head[0].shape[0])
            exit_layer = torch.full((batch,), -1, dtype=torch.long)
            before = stage.rows.tolist()
            stage, _ = cascade(runner, stage, ramps, self.exit_threshold, gates, widths, logits,
                               exit_layer)
            for row in before:
                layer = int(exit_layer[row])
                if layer >= 0:
                    summary = {"logits": logits[row].clone()}
                    skipped = self._skipped(gates, widths, probe, stage_until=layer)
                    finished.append((row, RowResult(summary, tier, 0.0, layer, skipped,
                                                    confidence_of(summary))))
        if stage is not None:
            runner.advance(stage, gates, widths)
            outputs = runner.result(stage)
            mask = stage.env[runner.mask_input]
            ids = stage.env[runner.ids_input]
            skipped = self._skipped(gates, widths, probe)
            for index, row in enumerate(stage.rows.tolist()):
                summary = self._summarise(outputs, ids, mask, index)
                finished.append((row, RowResult(summary, tier, 0.0, -1, skipped,
                                                confidence_of(summary))))
        return finished

    def _skipped(self, gates, widths, probe: int | None, stage_until: int | None = None) -> float:
        """Prunable FLOPs not computed: layers up to the probe (if one ran) ran in full; with
        `stage_until` (an early exit), layers after it did not run at all."""
        probe = -1 if probe is None else probe
        effective_gates, effective_widths = [], []
        for gate, on in enumerate(gates):
            layer = self._gate_layer[gate]
            effective_gates.append((on or layer <= probe) and
                                   (stage_until is None or layer <= stage_until))
            effective_widths.append(1.0 if layer <= probe or widths is None else widths[gate])
        return self.compiled.skipped_share(effective_gates, effective_widths)

    def _summarise(self, outputs, ids, mask, index) -> dict[str, torch.Tensor]:
        real = mask[index].bool()
        if self.compiled.family == "decoder":
            logits = outputs["logits"][index][real]
            log_probs = logits.log_softmax(-1)
            tokens = ids[index][real]
            top1 = log_probs.argmax(-1)
            return {"token_logprobs": log_probs[:-1].gather(1, tokens[1:, None]).squeeze(1),
                    "top1": top1, "next_token": top1[-1:],
                    "next_token_prob": log_probs[-1].max().exp().reshape(1)}
        hidden = outputs["last_hidden_state"][index:index + 1]
        summary = {"embedding": mean_pool(hidden, mask[index:index + 1])[0]}
        if self.compiled.offramps is not None:
            summary["logits"] = head_logits(self.compiled.offramps.head, hidden,
                                            mask[index:index + 1])[0]
        return summary


def confidence_of(summary: dict) -> float | None:
    """Max probability of a row's answer; None for embeddings."""
    if "logits" in summary:
        return float(summary["logits"].softmax(-1).max())
    if "next_token_prob" in summary:
        return float(summary["next_token_prob"])
    return None
