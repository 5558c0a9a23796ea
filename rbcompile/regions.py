"""The region contract in one place: the table of a generated module's regions and the
interpreter that runs them.

Every generated module (codegen.py) lists its regions in run order as `REGIONS`, a tuple of
`Region`s. Its `forward`, the staged runner (rbcompile/staged.py) and calibration read method
names from that table and run regions through `run_region`: a cache region through the module's
shape-keyed cache, a skeleton region always, a prunable region only when its gate is on (off:
its output is the residual stream it reads, an identity) and at the width level `width_level`
picks for `widths[gate]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
            values = _as_tuple(region, compute(*args))
        env.update(zip(region.outputs, values))
    _drop(region, env)


def _as_tuple(region: Region, values) -> tuple:
    """A region method's result as a tuple of its outputs."""
    return values if len(region.outputs) > 1 else (values,)


def _drop(region: Region, env: dict) -> None:
    for name in region.drop:
        env.pop(name, None)  # a seam's sum never enters `env`


def _runs_full(region: Region, gates, widths) -> bool:
    """`region` runs its full-width method under these gates and widths."""
    return region.kind == "skeleton" or (
        region.kind == "prunable" and bool(gates[region.gate])
        and width_method(region, widths) == region.method)


def run_regions(module, env: dict, gates, widths=None, guards: str = "python") -> dict:
    """Run every region of `module` (its `REGIONS`, in order) on `env`, the graph inputs by
    name; returns `env`, which then holds the graph outputs (see `run_region`).

    Seams (passes/mark_seams.py): when a region that ends in a residual add and the region
    after it both run at full width, the first leaves the add open (its seam method returns
    the sum's two terms) and the second adds them inside its first norm (one fused kernel
    instead of an add and a norm). Not with `guards="cond"`, nor with `module.fuse_seams`
    set to False."""
    regions = module.REGIONS
    seams = guards == "python" and getattr(module, "fuse_seams", True)
    terms = None  # the two terms of the sum the previous region left open
    for index, region in enumerate(regions):
        closes = terms is not None
        opens = (seams and region.seams[1] is not None
                 and (closes or _runs_full(region, gates, widths))
                 and _runs_full(regions[index + 1], gates, widths))
        if not (closes or opens):
            run_region(module, region, env, gates, widths, guards)
            continue
        sum_in, sum_out = region.seams
        args = [value for name in region.inputs
                for value in (terms if closes and name == sum_in else (env[name],))]
        variant = "+".join(side for side, on in (("in", closes), ("out", opens)) if on)
        values = getattr(module, dict(region.seam_methods)[variant])(*args)
        terms = None
        if opens:
            at = region.outputs.index(sum_out)
            env.update(zip(region.outputs[:at] + region.outputs[at + 1:],
                           values[:at] + values[at + 2:]))
            terms = values[at:at + 2]
        else:
            env.update(zip(region.outputs, _as_tuple(region, values)))
        _drop(region, env)
    return env


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
