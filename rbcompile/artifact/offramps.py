"""Early-exit off-ramps: linear classifiers over the mean-pooled stream after some layers, plus
the task head and the exit threshold, as an artifact stores them, and their training.

Calibration trains them to match the task head on the full path (distillation: the student's
softmax against the teacher's) and chooses the threshold on held-out data as the lowest one
whose exits disagree with the full path on at most `max_disagreement` of the samples.
runtime/control/early_exit.py runs them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rbcompile.artifact.quality import head_logits, mean_pool
from rbcompile.artifact.staged import StagedRunner

RAMP_FILE = "offramps.safetensors"


@dataclass
class OffRamps:
    layers: list[int]
    ramps: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (weight, bias)
    head: tuple[torch.Tensor, torch.Tensor]              # the task head on the full path
    threshold: float = 1.0

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"head.weight": self.head[0], "head.bias": self.head[1]}
        for layer, (weight, bias) in self.ramps.items():
            out[f"ramp{layer}.weight"], out[f"ramp{layer}.bias"] = weight, bias
        return {k: v.detach().contiguous() for k, v in out.items()}

    def to(self, device) -> "OffRamps":
        """The ramps and the head on `device` (the model's)."""
        def moved(pair):
            return tuple(tensor.to(device) for tensor in pair)
        return OffRamps(self.layers, {layer: moved(ramp) for layer, ramp in self.ramps.items()},
                        moved(self.head), self.threshold)

    @classmethod
    def from_tensors(cls, tensors: dict, layers: list[int], threshold: float) -> "OffRamps":
        ramps = {layer: (tensors[f"ramp{layer}.weight"], tensors[f"ramp{layer}.bias"])
                 for layer in layers}
        return cls(list(layers), ramps, (tensors["head.weight"], tensors["head.bias"]), threshold)


def default_ramp_layers(layers: list[int]) -> list[int]:
    """A ramp after every layer from the second to the one before last."""
    return layers[1:-1]


def pooled_streams(runner: StagedRunner, batches, layers: list[int], head):
    """Mean-pooled stream after each ramp layer, and the full path's task logits."""
    features = {layer: [] for layer in layers}
    teacher = []
    full = [True] * runner.module.NUM_GATES
    for ids, mask in batches:
        stage = runner.start(ids, mask)
        for layer in layers:
            runner.advance(stage, full, until_layer=layer)
            features[layer].append(mean_pool(runner.stream_value(stage), mask))
        teacher.append(head_logits(head, runner.result(runner.advance(stage, full))
                                   ["last_hidden_state"], mask))
    return {k: torch.cat(v) for k, v in features.items()}, torch.cat(teacher)


@torch.no_grad()
def train_offramps(compiled, calibration, heldout, head, *, layers=None, steps: int = 300,
                   max_disagreement: float = 0.01) -> OffRamps:
    """Fit one ramp per layer on `calibration` batches [(ids, mask)], pick the threshold on
    `heldout` batches."""
    runner = StagedRunner(compiled)
    layers = list(layers if layers is not None else default_ramp_layers(runner.layers))
    features, teacher = pooled_streams(runner, calibration, layers, head)
    target = teacher.softmax(-1)
    ramps = {}
    for layer in layers:
        weight = head[0].to(features[layer]).clone().requires_grad_(True)
        bias = head[1].to(features[layer]).clone().requires_grad_(True)
        optimiser = torch.optim.Adam([weight, bias], lr=0.01)
        with torch.enable_grad():
            for _ in range(steps):
                optimiser.zero_grad()
                logits = features[layer] @ weight.T + bias
                loss = F.cross_entropy(logits, target)
                loss.backward()
                optimiser.step()
        ramps[layer] = (weight.detach(), bias.detach())
    offramps = OffRamps(layers, ramps, (head[0].clone(), head[1].clone()))
    held_features, held_teacher = pooled_streams(runner, heldout, layers, head)
    offramps.threshold = choose_threshold(offramps, held_features, held_teacher.argmax(-1),
                                          max_disagreement)
    return offramps


def choose_threshold(offramps: OffRamps, features: dict, full_prediction: torch.Tensor,
                     max_disagreement: float) -> float:
    """The lowest confidence threshold whose exits change at most `max_disagreement` of the
    predictions (1.0: never exit)."""
    confidences, predictions = [], []
    for layer in offramps.layers:
        weight, bias = offramps.ramps[layer]
        probs = (features[layer] @ weight.T + bias).softmax(-1)
        confidence, prediction = probs.max(-1)
        confidences.append(confidence)
        predictions.append(prediction)
    best = 1.0
    for threshold in torch.linspace(0.5, 0.999, 100).flip(0).tolist():
        final = full_prediction.clone()
        undecided = torch.ones_like(full_prediction, dtype=torch.bool)
        for confidence, prediction in zip(confidences, predictions):
            exits = undecided & (confidence >= threshold)
            final[exits] = prediction[exits]
            undecided &= ~exits
        if (final != full_prediction).float().mean().item() <= max_disagreement:
            best = threshold
        else:
            break
    return best
