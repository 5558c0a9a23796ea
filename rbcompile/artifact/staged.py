"""Run a compiled module a few layers at a time, and regroup a batch between layers.

The generated `forward` runs all regions in one go. Early exit, the complexity probe and per-tier
execution need to stop after a layer, look at the residual stream, and continue with only some
rows (or only the last positions) of the batch as a smaller batch: regrouping, not masking.

A `Stage` holds the live values after some region. `select` builds the smaller batch: the
residual stream is sliced, and every other live value (shape symbols, masks, rotary tables) is
recomputed from the sliced inputs by re-running the input-only regions that made it.
Regions run from the generated module's region table through the same interpreter as its
`forward` (rbcompile/artifact/regions.py; tests hold `run` equal to `forward`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rbcompile.artifact.architectures import REGISTRY
from rbcompile.artifact.regions import run_region
from rbcompile.errors import CompileError


@dataclass
class Stage:
    env: dict                      # live values by name (graph inputs included)
    position: int = 0              # index of the next region to run
    stream: str | None = None      # name of the residual stream after the last prunable region
    rows: torch.Tensor | None = field(default=None)  # original row indices of this batch


class StagedRunner:
    """Region-by-region execution of `compiled.module` (a CompiledModel's generated module)."""

    def __init__(self, compiled):
        self.module = compiled.module
        self.table = compiled.module.REGIONS  # what runs, in order (rbcompile/artifact/regions.py)
        self.regions = compiled.regions       # the IR's regions: names and layers
        self.input_names = list(compiled.ir["inputs"])
        architecture = REGISTRY[compiled.manifest["architecture"]["model_type"]]
        self.mask_input = architecture.mask_input  # the attention mask's name in `env`
        self.ids_input = architecture.inputs[0]
        self.outputs = [(name, var) for name, var in compiled.ir["outputs"]]
        self.producer = {name: index for index, region in enumerate(self.table)
                         for name in region.outputs}
        self.layer_end = {}  # layer -> index of its last region
        for index, region in enumerate(self.regions):
            if region["kind"] == "prunable":
                self.layer_end[region["layer"]] = index
        self.layers = sorted(self.layer_end)

    # ---- running ----------------------------------------------------------------------------

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Stage:
        """A stage before the first region, its inputs on the module's device."""
        device = self.module.device
        env = dict(zip(self.input_names, (input_ids.to(device), attention_mask.to(device))))
        return Stage(env, rows=torch.arange(input_ids.shape[0], device=device))

    def advance(self, stage: Stage, gates, widths=None, until_layer: int | None = None) -> Stage:
        """Run regions up to and including the last one of `until_layer` (None: to the end)."""
        stop = len(self.table) if until_layer is None else self.layer_end[until_layer] + 1
        for region in self.table[stage.position:stop]:
            run_region(self.module, region, stage.env, gates, widths)
            if region.kind == "prunable":
                stage.stream = region.skip[0]
        stage.position = max(stage.position, stop)
        return stage

    def _live_after(self, position: int) -> set[str]:
        """Names made before `position` that later regions or the graph outputs read."""
        names = {var for _, var in self.outputs}
        for region in self.table[position:]:
            names.update(region.inputs)
        return {n for n in names if self.producer.get(n, -1) < position}

    def _drop_dead(self, stage: Stage) -> None:
        live = self._live_after(stage.position) | set(self.input_names)
        stage.env = {k: v for k, v in stage.env.items() if k in live}

    def result(self, stage: Stage) -> dict[str, torch.Tensor]:
        """Graph outputs of a stage that has run to the end."""
        return {name: stage.env[var] for name, var in self.outputs}

    def run(self, input_ids, attention_mask, gates, widths=None) -> dict[str, torch.Tensor]:
        return self.result(self.advance(self.start(input_ids, attention_mask), gates, widths))

    # ---- regrouping -------------------------------------------------------------------------

    def stream_value(self, stage: Stage) -> torch.Tensor:
        if stage.stream is None:
            raise CompileError("no residual stream yet: advance past a layer first")
        return stage.env[stage.stream]

    def select(self, stage: Stage, rows: torch.Tensor | None = None,
               last_positions: int | None = None) -> Stage:
        """A new stage for `rows` of the batch (and/or only its last positions). The stream is
        sliced; every other live value is recomputed from the sliced inputs."""
        stream = self.stream_value(stage)
        inputs = {name: stage.env[name] for name in self.input_names}
        if rows is not None:
            stream = stream.index_select(0, rows)
            inputs = {k: v.index_select(0, rows) for k, v in inputs.items()}
        if last_positions is not None:
            stream = stream[:, -last_positions:]
            inputs = {k: v[:, -last_positions:] for k, v in inputs.items()}
        live = self._live_after(stage.position) - {stage.stream} - set(self.input_names)
        needed = self._input_only_closure(live)
        env = dict(inputs)
        full = [True] * self.module.NUM_GATES
        for index in needed:
            run_region(self.module, self.table[index], env, full)
        env[stage.stream] = stream
        new_rows = stage.rows if rows is None else stage.rows.index_select(0, rows)
        new = Stage(env, stage.position, stage.stream, new_rows)
        self._drop_dead(new)
        return new

    def _input_only_closure(self, names: set[str]) -> list[int]:
        """Indices of the regions that recompute `names` from the graph inputs alone."""
        needed, pending = set(), [n for n in names if n not in self.input_names]
        while pending:
            index = self.producer[pending.pop()]
            if index in needed:
                continue
            if self.table[index].kind == "prunable":
                raise CompileError(f"cannot regroup: {self.regions[index]['name']} feeds a "
                                   "later region other than through the residual stream")
            needed.add(index)
            pending += [n for n in self.table[index].inputs if n not in self.input_names]
        return sorted(needed)
