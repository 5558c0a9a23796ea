"""The region contract in one place: the table of a generated module's regions and the
interpreter that runs them.

Every generated module (codegen.py) lists its regions in run order as `REGIONS`, a tuple of
`Region`s. The staged runner (rbcompile/artifact/staged.py) and calibration read method names from that
table and run regions one at a time through `run_region`: a cache region through the module's
shape-keyed cache, a skeleton region always, a prunable region only when its gate is on (off:
its output is the residual stream it reads, an identity) and at the width level `width_level`
picks for `widths[gate]`. A whole forward runs a plan's `plan_steps` (the same choices, plus
seams between regions that both run) through `run_steps`, or, compiled, through
rbcompile/artifact/plan_graphs.py, which writes the same steps as Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class Plan(NamedTuple):
    """What one forward runs: `gates`, one per prunable region (False: skipped), and `widths`,
    a width ratio per gate (None: every region at full width). Made from a budget by
    plans.plan_for_budget; `key` names it in every plan cache (the steps here, compiled plan
    graphs, CUDA graphs)."""
    gates: list[bool]
    widths: list[float] | None = None

    @property
    def key(self) -> tuple:
        return (tuple(bool(gate) for gate in self.gates),
                None if self.widths is None else tuple(self.widths))


@dataclass(frozen=True)
class Region:
    """One region of a generated module: its method `method` computes `outputs` from `inputs`
    (names of values in the interpreter's environment)."""
    id: int
    kind: str                                   # "cache" | "skeleton" | "prunable"
    method: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    gate: int | None = None                     # prunable: its index in `gates` and `widths`
    skip: tuple[str, str] | None = None         # prunable: (output, input it is when skipped)
    levels: tuple[tuple[float, str], ...] = ()  # prunable: (width ratio, method), widest first
    drop: tuple[str, ...] = ()                  # inputs no later region nor the outputs read
    # seams (see `run_regions`): (the sum the previous region may leave open, which this
    # region's first norm then adds; the sum this region may leave open), and the methods
    # that do so: "in" -> the first, "out" -> the second, "in+out" -> both
    seams: tuple[str | None, str | None] = (None, None)
    seam_methods: tuple[tuple[str, str], ...] = ()

    @property
    def methods(self) -> tuple[str, ...]:
        """The region's methods: full width, then each width level, then its seam variants."""
        return (self.method, *(method for _, method in self.levels),
                *(method for _, method in self.seam_methods))


@dataclass(frozen=True)
class Unpadded:
    """The masks that say nothing but causality when the mask input has no padding
    (passes/unpadded_attention.py). A call given `input` as None (no padding) fills it with
    ones, each dimension as long as dimension `dim` of input `name` in `like`, and drops
    `masks` after the region that makes them: attention then reads no mask (`is_causal`
    where `causal`: the tokens after the last one change nothing before them, so right padding
    added by the runtime needs no mask either). `start`: an input whose first value must be 0
    in such a call (the KV-cached decoder's cache positions: a prefill from the first slot)."""
    input: str
    like: tuple[tuple[str, int], ...]
    masks: tuple[str, ...]
    causal: bool
    start: str | None = None


def unpadded_call(module, inputs: dict) -> bool:
    """Whether a call of `module` on `inputs` (by name) runs without padding: the module drops
    its masks then (`UNPADDED`) and the mask input is None."""
    spec = getattr(module, "UNPADDED", None)
    return spec is not None and inputs.get(spec.input, 0) is None


def width_level(ratios, width: float | None) -> float | None:
    """The width level (a ratio among `ratios`) a request for `width` runs at: the narrowest
    level >= `width`, so a request below the lowest level runs at the lowest (the floor); None
    (full width) for no request or one above every level."""
    if width is None or not ratios or width > max(ratios):
        return None
    return min(ratio for ratio in ratios if ratio >= width)


def width_method(region: Region, widths) -> str:
    """The method of a prunable region at the width `widths` asks for its gate."""
    ratio = width_level([ratio for ratio, _ in region.levels],
                        None if widths is None else widths[region.gate])
    return region.method if ratio is None else dict(region.levels)[ratio]


def run_region(module, region: Region, env: dict, gates, widths=None,
               guards: str = "python") -> None:
    """Run `region` of `module` on the values in `env` (by name): store its outputs there and
    drop the values no later region reads. `guards="python"`: `gates` are bools; "cond" (a
    trace for ONNX export): `gates` is a bool tensor, each gate a `torch.cond`, and cache
    regions are computed, not looked up."""
    args = [env[name] for name in region.inputs]
    if region.kind == "prunable":
        out, stream_in = region.skip
        if guards == "cond":
            env[out] = _cond(gates[region.gate], getattr(module, width_method(region, widths)),
                             region.inputs.index(stream_in), args)
        elif gates[region.gate]:
            env[out] = getattr(module, width_method(region, widths))(*args)
        else:
            env[out] = env[stream_in]
    else:
        compute = getattr(module, region.method)
        if region.kind == "cache" and guards == "python":
            values = module.region_cache.lookup(region.id, compute, *args)
        else:
            values = compute(*args)
            values = values if len(region.outputs) > 1 else (values,)
        env.update(zip(region.outputs, values))
    for name in region.drop:
        del env[name]


def _runs_full(region: Region, gates, widths) -> bool:
    """`region` runs its full-width method under these gates and widths."""
    return region.kind == "skeleton" or (
        region.kind == "prunable" and gates[region.gate]
        and width_method(region, widths) == region.method)


@dataclass(frozen=True)
class Step:
    """One step of a plan: `method` computes `outputs` from `inputs` (names of values), or,
    for a skipped region (`method` None), `outputs[0]` is `inputs[0]`; then `drop` goes."""
    region: Region
    method: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    drop: tuple[str, ...]
    absent: tuple[str, ...] = ()   # outputs replaced by None (masks a call without padding drops)


_MAX_PLANS_KEPT = 512  # plans whose steps a module keeps


def seam_terms(sum_name: str) -> tuple[str, str]:
    """The names a plan gives the two terms of an open seam's sum."""
    return f"{sum_name}_residual", f"{sum_name}_branch"


def _apart(names, sum_name: str | None, on: bool) -> tuple[str, ...]:
    return tuple(part for name in names
                 for part in (seam_terms(name) if on and name == sum_name else (name,)))


def _plan_steps(regions: tuple[Region, ...], gates: tuple[bool, ...], widths, seams: bool,
                absent: tuple[str, ...]):
    steps, open_seam = [], False
    for index, region in enumerate(regions):
        closes = open_seam
        open_seam = bool(seams and region.seams[1] is not None
                         and (closes or _runs_full(region, gates, widths))
                         and _runs_full(regions[index + 1], gates, widths))
        sum_in, sum_out = region.seams
        inputs = _apart(region.inputs, sum_in, closes)
        drop = region.drop + (seam_terms(sum_in) if closes else ())
        if closes or open_seam:
            variant = "+".join(side for side, on in (("in", closes), ("out", open_seam)) if on)
            method = dict(region.seam_methods)[variant]
        elif region.kind == "prunable":
            out, stream_in = region.skip
            if not gates[region.gate]:
                steps.append(Step(region, None, (stream_in,), (out,), drop))
                continue
            method = width_method(region, widths)
        else:
            method = region.method
        steps.append(Step(region, method, inputs, _apart(region.outputs, sum_out, open_seam),
                          drop, tuple(name for name in region.outputs if name in absent)))
    return tuple(steps)


def plan_cache_key(module, gates, widths=None, unpadded: bool = False) -> tuple:
    """What makes `module`'s steps differ between calls: the gates, the widths, seams on, the
    masks a call without padding drops (see `Unpadded`)."""
    return (*Plan(gates, widths).key, bool(getattr(module, "fuse_seams", True)),
            module.UNPADDED.masks if unpadded else ())


def plan_steps(module, gates, widths=None, unpadded: bool = False) -> tuple[Step, ...]:
    """The steps `module` runs for one plan (gates as bools, widths), in order: each region's
    method at the width level it runs at, skipped regions as identities, and seams
    (passes/mark_seams.py): when a region that ends in a residual add and the region after it
    both run at full width, the first leaves the add open (its seam method returns the sum's
    two terms) and the second adds them inside its first norm (one fused kernel instead of an
    add and a norm); not with `module.fuse_seams` set to False. `unpadded`: a call without
    padding, whose masks are None from the region that makes them on (see `Unpadded`)."""
    key = plan_cache_key(module, gates, widths, unpadded)
    cache = module.__dict__.setdefault("_steps_by_plan", {})
    if key not in cache:
        if len(cache) >= _MAX_PLANS_KEPT:
            cache.clear()
        cache[key] = _plan_steps(module.REGIONS, *key)
    return cache[key]


def run_steps(module, steps, env: dict) -> dict:
    """Run `steps` (see `plan_steps`) of `module` on the values in `env`; cache regions are
    looked up in the module's shape-keyed cache."""
    for step in steps:
        if step.method is None:
            env[step.outputs[0]] = env[step.inputs[0]]
        else:
            args = [env[name] for name in step.inputs]
            compute = getattr(module, step.method)
            if step.region.kind == "cache":
                values = module.region_cache.lookup(step.region.id, compute, *args)
            else:
                values = compute(*args)
                values = values if len(step.outputs) > 1 else (values,)
            env.update(zip(step.outputs, values))
            if step.absent:
                env.update(dict.fromkeys(step.absent))
        for name in step.drop:
            env.pop(name, None)  # a seam's sum never enters `env`
    return env


def fill_unpadded(module, env: dict) -> bool:
    """For a call without padding (see `Unpadded`): the mask input in `env`, given as None,
    becomes ones of its shape; returns whether the call is one."""
    if not unpadded_call(module, env):
        return False
    spec = module.UNPADDED
    env[spec.input] = env[spec.like[0][0]].new_ones(
        tuple(env[name].shape[dim] for name, dim in spec.like))
    return True


def run_regions(module, env: dict, gates, widths=None, guards: str = "python") -> dict:
    """Run every region of `module` (its `REGIONS`, in order) on `env`, the graph inputs by
    name; returns `env`, which then holds the graph outputs. `guards="python"`: the steps of
    this plan (`plan_steps`; the mask input None: a call without padding, see `Unpadded`);
    "cond": each region through `run_region`."""
    if guards == "cond":
        for region in module.REGIONS:
            run_region(module, region, env, gates, widths, guards)
        return env
    unpadded = fill_unpadded(module, env)
    return run_steps(module, plan_steps(module, gates, widths, unpadded), env)


def _cond(gate, branch, stream: int, operands: list):
    """torch.cond on the bool tensor `gate`: `branch(*operands)`, or a copy of `operands[stream]`
    (branch outputs must not alias inputs). cond takes tensor operands only, so the sizes
    (SymInts) among `operands` travel as the shape of an empty tensor."""
    is_size = [not isinstance(value, torch.Tensor) for value in operands]
    sizes = [value for value, size in zip(operands, is_size) if size]
    tensors = [value for value, size in zip(operands, is_size) if not size]
    carrier = operands[stream].new_empty((0, *sizes))

    def run(carrier, *tensors):
        sizes, tensors = iter(carrier.shape[1:]), iter(tensors)
        return branch(*(next(sizes) if size else next(tensors) for size in is_size))

    def skip(carrier, *tensors):
        return tensors[stream - sum(is_size[:stream])].clone()

    return torch.cond(gate, run, skip, (carrier, *tensors))
