"""One compiled graph per plan: a plan's steps (regions.plan_steps) written as straight-line
Python and compiled whole with torch.compile, so inductor fuses across region boundaries and
a call runs one graph with no region interpreter in between.

`PlanGraphs` stands in for a generated module's `forward` (`compile_plans`). For each plan
(gates, widths) it writes the plan's function once (`source`), compiles it on first use and
keeps at most `max_plans` of them, least recently used dropped; each plan is its own function,
so dynamo's guards and recompile limit apply per plan. Cache regions are computed in the graph
(no shape-keyed lookup), skipped regions are renamings, seams are taken as the interpreter
takes them. Compared with per-region compilation (`compile_regions`), a new plan costs a
compile of the whole model and a call costs one graph; CUDA graphs per plan (cuda_graphs.py)
capture the compiled plan as they capture the interpreter. A plan whose compile fails (an
inductor bug: torch 2.11's CPU code generator on the KV-cached decoder's causal mask at
dynamic shapes) runs through the region interpreter from then on, with a warning and
`stats.failures` counted.
"""
from __future__ import annotations

import functools
import logging
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch

from rbcompile.artifact.module import show_source
from rbcompile.artifact.regions import plan_cache_key, plan_steps, seam_terms
from rbcompile.errors import CompileError

logger = logging.getLogger("rbcompile.artifact.plan_graphs")


def plan_source(module, steps, results, unpadded: bool = False) -> str:
    """The Python of one plan's function `plan(self, *module.INPUTS)`: one line per step,
    returning the values named `results` (the graph's outputs). `unpadded`: for calls
    without padding (regions.Unpadded), which fill the mask input as `fill_unpadded` does."""
    names = {*module.INPUTS, *(name for r in module.REGIONS for name in (*r.inputs, *r.outputs))}
    terms = {term for r in module.REGIONS for name in r.seams if name for term in seam_terms(name)}
    if terms & names:
        raise CompileError(f"seam term names {sorted(terms & names)} collide with graph values")
    lines = [f"def plan(self, {', '.join(module.INPUTS)}):"]
    if unpadded:
        spec = module.UNPADDED
        sizes = ", ".join(f"{name}.shape[{dim}]" for name, dim in spec.like)
        lines.append(f"    {spec.input} = {spec.like[0][0]}.new_ones(({sizes}))  # no padding")
    defined = set(module.INPUTS)
    for step in steps:
        if step.method is None:
            lines.append(f"    {step.outputs[0]} = {step.inputs[0]}  # region {step.region.id} "
                         "skipped")
        else:
            lines.append(f"    {', '.join(step.outputs)} = self.{step.method}"
                         f"({', '.join(step.inputs)})")
            lines += [f"    {name} = None  # no padding: attention without this mask"
                      for name in step.absent]
        defined.update(step.outputs)
        dead = [name for name in step.drop if name in defined]
        if dead:
            lines.append(f"    del {', '.join(dead)}")
            defined.difference_update(dead)
    return "\n".join(lines + [f"    return ({', '.join(results)},)"]) + "\n"


@dataclass
class PlanStats:
    compiles: int = 0    # plan functions written and compiled
    calls: int = 0
    evictions: int = 0
    failures: int = 0    # plans whose compile failed: they run through the interpreter


class PlanGraphs:
    """A generated module's `forward` through one compiled function per plan (see the module
    docstring): `results` names the values its `forward` returns (the IR's outputs);
    `compiler(fn)` compiles a plan function (default: inductor)."""

    def __init__(self, module, results, *, max_plans: int = 8, compiler=None):
        if max_plans < 1:
            raise ValueError("max_plans must be >= 1")
        self.module, self.results, self.max_plans = module, tuple(results), max_plans
        self.compiler = compiler or (lambda fn: torch.compile(fn, backend="inductor"))
        self.interpreter = types.MethodType(type(module).forward, module)  # the region interpreter
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        spec = getattr(module, "UNPADDED", None)  # where a call without padding passes None
        self._mask_at = None if spec is None else module.INPUTS.index(spec.input)
        self.stats = PlanStats()

    def source(self, gates, widths=None, unpadded: bool = False) -> str:
        """The function this plan runs, as Python (`unpadded`: for calls without padding)."""
        return plan_source(self.module, plan_steps(self.module, gates, widths, unpadded),
                           self.results, unpadded)

    def __len__(self) -> int:
        return len(self._plans)

    def keys(self) -> list[tuple]:
        return list(self._plans)

    def _function(self, key, gates, widths, unpadded):
        function = self._plans.get(key)
        if function is not None:
            self._plans.move_to_end(key)
            return function
        source = self.source(gates, widths, unpadded)
        # a file name of its own (see module.instantiate): the plans of another module, seen
        # at other shapes, must not make this plan's first compile dynamic
        filename = f"<rbcompile plan {self.stats.compiles} of {type(self.module).__module__}>"
        show_source(filename, source, self.module)
        namespace: dict = {}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - written just above
        function = self.compiler(types.MethodType(namespace["plan"], self.module))
        self.stats.compiles += 1
        logger.info("plan %s: compiled (%d kept)", key, len(self._plans) + 1)
        self._plans[key] = function
        if len(self._plans) > self.max_plans:
            self._plans.popitem(last=False)
            self.stats.evictions += 1
        return function

    def __call__(self, *args, gates=None, widths=None):
        count = len(self.module.INPUTS)
        inputs, rest = args[:count], list(args[count:])
        gates = rest.pop(0) if rest else gates
        widths = rest.pop(0) if rest else widths
        self.stats.calls += 1
        unpadded = self._mask_at is not None and inputs[self._mask_at] is None
        key = plan_cache_key(self.module, gates, widths, unpadded)
        function = self._function(key, gates, widths, unpadded)
        with torch.no_grad():  # inference graphs: nothing to differentiate
            try:
                return tuple(function(*inputs))
            except Exception as exc:
                from torch._dynamo.exc import BackendCompilerFailed  # inductor's errors too

                interpreted = isinstance(function, functools.partial)  # failed before
                if interpreted or not isinstance(exc, BackendCompilerFailed):
                    raise
                logger.warning("plan %s: the compiler failed (%s); it runs through the region "
                               "interpreter", key, str(exc).strip().splitlines()[0][:200])
                self.stats.failures += 1
                self._plans[key] = functools.partial(self.interpreter, gates=gates, widths=widths)
                return tuple(self._plans[key](*inputs))


def compile_plans(module, ir: dict, *, max_plans: int = 8, compiler=None) -> PlanGraphs:
    """Run `module` (generated from `ir`) through one compiled graph per plan from now on;
    returns the `PlanGraphs` now standing in for its `forward`."""
    plans = PlanGraphs(module, [name for _, name in ir["outputs"]], max_plans=max_plans,
                       compiler=compiler)
    module.forward = plans
    return plans
