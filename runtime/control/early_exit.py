"""Early exit for encoder classifiers (DeeBERT style), with regrouping.

Off-ramps (rbcompile/artifact/offramps.py, trained during calibration) are linear classifiers over the
mean-pooled residual stream after some layers. At run time the batch stops after each ramp's
layer: rows whose ramp is confident (max probability >= threshold) exit with the ramp's
prediction, and the unconfident rest continues as a smaller batch (rows selected, not masked),
so batching and early exit work together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rbcompile.artifact.offramps import OffRamps
from rbcompile.artifact.quality import head_logits
from rbcompile.artifact.staged import StagedRunner


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
        mask = stage.env[runner.mask_input]
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
    logits = torch.empty(batch, offramps.head[0].shape[0], device=compiled.device)
    exit_layer = torch.full((batch,), -1, dtype=torch.long, device=compiled.device)
    stage, sizes = cascade(runner, runner.start(input_ids, attention_mask), offramps, threshold,
                           gates, widths, logits, exit_layer)
    if stage is not None:
        runner.advance(stage, gates, widths)
        mask = stage.env[runner.mask_input]
        logits[stage.rows] = head_logits(offramps.head,
                                         runner.result(stage)["last_hidden_state"], mask)
    return ExitResult(logits, exit_layer, sizes)
