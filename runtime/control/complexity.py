"""Input-complexity scores in [0, 1], far cheaper than the model, and tiers built on them.

Cheap terms read only token ids: a length term (real tokens / `long_input`, capped at 1) and the
density of rare tokens (ids in the upper half of the vocabulary: BPE and WordPiece vocabularies
add rarer pieces later, so a high id is a cheap proxy for terminology and rare words).

The early-layer term needs the first layers, which the tiered executor runs anyway (their
results are reused, not recomputed): for decoders the logit-lens entropy of the last few
positions after the probe layer (normalised by log(vocab)); for encoders with off-ramps,
1 - the first ramp's confidence.

    score = (w_length * length + w_rare * rarity + w_early * uncertainty) / (sum of used weights)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from rbcompile.artifact.input_complexity import LengthRarityComplexity
from rbcompile.artifact.quality import head_logits


@dataclass
class ComplexityWeights:
    length: float = 0.25
    rarity: float = 0.25
    early: float = 0.5


class ComplexityEstimator:
    """Scores a batch; `probe_layer` is where the early-layer term is read."""

    LENS_POSITIONS = 8  # decoders: the logit lens reads only the last positions

    def __init__(self, compiled, weights: ComplexityWeights | None = None, long_input: int = 256):
        self.compiled = compiled
        self.weights = weights or ComplexityWeights()
        self.cheap = LengthRarityComplexity(compiled.vocab_size, long_input)
        layers = sorted({r["layer"] for r in compiled.regions if r["kind"] == "prunable"})
        ramps = compiled.offramps
        if compiled.family == "encoder":
            self.probe_layer = ramps.layers[0] if ramps is not None else None
        else:  # after about a tenth of the depth, at least one layer
            self.probe_layer = layers[max(0, round(0.1 * len(layers)) - 1)] if len(layers) > 2 else None

    def cheap_score(self, input_ids, attention_mask) -> torch.Tensor:
        length_term, rare = self.cheap.terms(input_ids, attention_mask)
        w = self.weights
        return (w.length * length_term + w.rarity * rare) / (w.length + w.rarity)

    def uncertainty(self, runner, stage) -> torch.Tensor:
        """Early-layer uncertainty in [0, 1] per row of a stage that has run the probe layer."""
        mask = stage.env[runner.mask_input]
        if self.compiled.family == "encoder":
            ramp = self.compiled.offramps.ramps[self.probe_layer]
            probs = head_logits(ramp, runner.stream_value(stage), mask).softmax(-1)
            classes = probs.shape[-1]
            return ((1 - probs.max(-1).values) * classes / (classes - 1)).clamp(0, 1)
        positions = min(self.LENS_POSITIONS, mask.shape[1])
        lens = runner.select(stage, last_positions=positions)
        later_off = [r["layer"] <= self.probe_layer
                     for r in sorted((r for r in self.compiled.regions if r["kind"] == "prunable"),
                                     key=lambda r: r["gate"])]
        logits = runner.result(runner.advance(lens, later_off))["logits"]
        log_probs = logits.float().log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) / math.log(logits.shape[-1])
        real = mask[:, -positions:].float()
        return (entropy * real).sum(1) / real.sum(1).clamp(min=1)

    def score(self, input_ids, attention_mask, uncertainty: torch.Tensor | None = None):
        """Combined score per row; without `uncertainty`, the cheap terms only."""
        cheap = self.cheap_score(input_ids, attention_mask)
        if uncertainty is None:
            return cheap
        w = self.weights
        return ((w.length + w.rarity) * cheap + w.early * uncertainty) / (w.length + w.rarity + w.early)


class Tier(IntEnum):
    """A request's tier, cheapest first (an index into `Tiers.scales`)."""
    LIGHT = 0
    MEDIUM = 1
    FULL = 2


@dataclass
class Tiers:
    """Score -> tier: below `light_below` light, below `full_from` medium, else full. Each tier
    runs the decided budget times its scale (light 1.0, medium 0.5, full 0: the full path).
    `full_from = 0` makes every request full and `light_below = 1` every request light: then
    no probe runs."""
    light_below: float = 0.35
    full_from: float = 0.65
    scales: tuple[float, float, float] = (1.0, 0.5, 0.0)

    def __post_init__(self):
        if not 0 <= self.light_below <= self.full_from <= 1:
            raise ValueError("tier thresholds must satisfy 0 <= light_below <= full_from <= 1")

    def shifted(self, shift: float) -> "Tiers":
        """Both thresholds moved the share `shift` of the way to 1 (1: every request light):
        under load a controller sends more requests to the cheaper tiers."""
        if shift <= 0:
            return self
        move = lambda threshold: threshold + shift * (1 - threshold)  # noqa: E731
        return Tiers(move(self.light_below), move(self.full_from), self.scales)

    def constant(self) -> Tier | None:
        """The tier of every request when the thresholds leave no choice, else None."""
        if self.full_from <= 0:
            return Tier.FULL
        return Tier.LIGHT if self.light_below >= 1 else None

    def tier(self, score: float) -> Tier:
        constant = self.constant()
        if constant is not None:
            return constant
        if score < self.light_below:
            return Tier.LIGHT
        return Tier.MEDIUM if score < self.full_from else Tier.FULL

    def budget(self, tier: Tier, budget: float) -> float:
        return budget * self.scales[tier]
