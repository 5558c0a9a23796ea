"""Early exit for encoder classifiers (DeeBERT style), with regrouping.

Off-ramps are linear classifiers over the mean-pooled residual stream after some layers, trained
during calibration to match the task head on the full path (distillation: the student's softmax
against the teacher's). At run time the batch stops after each ramp's layer: rows whose ramp is
confident (max probability >= threshold) exit with the ramp's prediction, and the unconfident
rest continues as a smaller batch (rows selected, not masked), so batching and early exit work
together. The threshold is chosen on held-out calibration data as the lowest one whose exits
disagree with the full path on at most `max_disagreement` of the samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..offramps import OffRamps
from ..quality import head_logits, mean_pool
from .staged import StagedRunner

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
        weight = head[0].clone().requires_grad_(True)
        bias = head[1].clone().requires_grad_(True)
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


@dataclass
class ExitResult:
    logits: torch.Tensor        # [batch, classes]: the ramp's for rows that exited, else the head's
    exit_layer: torch.Tensor    # [batch]: the layer a row exited after; -1 = ran the full path
    batch_sizes: list[int]      # rows still running after each ramp (regrouped batch sizes)


def cascade(runner: StagedRunner, stage, offramps: OffRamps, threshold: float, gates, widths,
            logits: torch.Tensor, exit_layer: torch.Tensor):
    """Run `stage` through the remaining ramps, writing the logits and exit layer of rows that
    exit (indexed by their original row); returns the stage of the rows still running (None when
    all exited) and the batch size after each ramp."""
    sizes = []
    for layer in offramps.layers:
        if runner.layer_end[layer] + 1 < stage.position:
            continue  # a ramp the stage has already passed
        runner.advance(stage, gates, widths, until_layer=layer)
        mask = stage.env[runner.input_names[1]]
        ramp_logits = head_logits(offramps.ramps[layer], runner.stream_value(stage), mask)
        confident = ramp_logits.softmax(-1).max(-1).values >= threshold
        logits[stage.rows[confident]] = ramp_logits[confident]
        exit_layer[stage.rows[confident]] = layer
        if bool(confident.all()):
            return None, sizes + [0]
        if bool(confident.any()):
            stage = runner.select(stage, rows=torch.nonzero(~confident).flatten())
        sizes.append(len(stage.rows))
    return stage, sizes


@torch.no_grad()
def run_with_exits(compiled, offramps: OffRamps, input_ids, attention_mask, gates=None,
                   widths=None, threshold: float | None = None) -> ExitResult:
    """Classify a batch, letting confident rows stop at the off-ramps."""
    runner = StagedRunner(compiled)
    threshold = offramps.threshold if threshold is None else threshold
    gates = gates if gates is not None else [True] * compiled.num_gates
    batch = input_ids.shape[0]
    logits = torch.empty(batch, offramps.head[0].shape[0])
    exit_layer = torch.full((batch,), -1, dtype=torch.long)
    stage, sizes = cascade(runner, runner.start(input_ids, attention_mask), offramps, threshold,
                           gates, widths, logits, exit_layer)
    if stage is not None:
        runner.advance(stage, gates, widths)
        mask = stage.env[runner.input_names[1]]
        logits[stage.rows] = head_logits(offramps.head,
                                         runner.result(stage)["last_hidden_state"], mask)
    return ExitResult(logits, exit_layer, sizes)
