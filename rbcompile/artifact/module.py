"""The generated module at run time: instantiate generated source, attach weights, compile its
regions. Used by the compiler and by artifact loading alike; imports nothing of the compiler
(loading an artifact never imports the passes)."""
from __future__ import annotations

import itertools
import linecache
import sys
import types
import weakref

import torch

from rbcompile.errors import UserError

_module_ids = itertools.count()


def instantiate(source: str, tag: str) -> torch.nn.Module:
    """Execute generated source (and only that) in a fresh module and return an empty
    GeneratedModel. The module is importable (`sys.modules`, under a name of its own) while
    the model lives: dynamo imports the module of every global the code it inlines reads.
    Its file name is its own too: dynamo keeps what it learnt of a function's shapes
    (automatic dynamic) by file name, line and name, so two modules generated alike must not
    share one."""
    namespace = types.ModuleType(f"rbcompile_generated_{next(_module_ids)}")
    filename = f"<rbcompile generated {tag} in {namespace.__name__}>"
    exec(compile(source, filename, "exec"), vars(namespace))  # noqa: S102 - our generated code
    sys.modules[namespace.__name__] = namespace
    model = namespace.GeneratedModel()
    weakref.finalize(model, sys.modules.pop, namespace.__name__, None)
    show_source(filename, source, model)
    return model


def show_source(filename: str, source: str, owner) -> None:
    """Let tracebacks and dynamo read generated `source` under `filename` while `owner` lives."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    weakref.finalize(owner, linecache.cache.pop, filename, None)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a generated module holds, by weight key (what `attach_weights` takes)."""
    return {key: module.get_buffer(name) for name, key in module.PARAMETERS.items()}


def stacks(module: torch.nn.Module) -> dict[str, list[str]]:
    """A generated module's stacked weights: key -> the keys of its parts (codegen writes the
    table only where the graph stacks weights)."""
    return getattr(module, "CONCATENATED", {})


def stored_weights(modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The tensors generated modules hold, by key, without the stacks `attach_weights` makes
    (an artifact stores their parts)."""
    stacked = {key for module in modules for key in stacks(module)}
    return {key: tensor for module in modules for key, tensor in weights(module).items()
            if key not in stacked}


def stack_parts(tensors: dict[str, torch.Tensor],
                concatenated: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """`tensors` with each stack of `concatenated` (key -> part keys) made by rows, and its
    parts replaced by views of it: the weights are held once."""
    tensors = dict(tensors)
    for key, parts in concatenated.items():
        missing = [part for part in parts if part not in tensors]
        if missing:
            raise UserError(f"weights are missing {missing[0]}, a part of {key}")
        try:
            stack = torch.cat([tensors[part] for part in parts])
        except RuntimeError:
            raise UserError(f"weights cannot be stacked into {key}: their shapes differ") from None
        tensors[key], start = stack, 0
        for part in parts:
            rows = tensors[part].shape[0]
            tensors[part], start = stack.narrow(0, start, rows), start + rows
    return tensors


def attach_weights(modules: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Register each tensor named in a module's PARAMETERS as its buffer; strict on missing
    keys. The stacks the modules' CONCATENATED tables name are made first, once for all of
    them (`stack_parts`), so modules that share weights share them after too."""
    tensors = stack_parts(tensors, {key: parts for module in modules
                                    for key, parts in stacks(module).items()})
    for module in modules:
        missing = [key for key in module.PARAMETERS.values() if key not in tensors]
        if missing:
            raise UserError(f"weights are missing {len(missing)} tensors, e.g. {missing[0]}")
        for name, key in module.PARAMETERS.items():
            module.register_buffer(name, tensors[key])
        for name, (key, axis, length) in module.PARAMETER_VIEWS.items():
            if key not in tensors or tensors[key].dim() <= axis or tensors[key].shape[axis] < length:
                raise UserError(f"weights cannot provide the view {name} of {key}")
            module.register_buffer(name, tensors[key].narrow(axis, 0, length), persistent=False)


def compile_regions(module: torch.nn.Module) -> None:
    """Compile every region method of a generated module (its `REGIONS` table) with inductor
    (the gate and width choices between them stay Python, so a new decision never recompiles)."""
    for name in [name for region in module.REGIONS for name in region.methods]:
        setattr(module, name, torch.compile(getattr(module, name), backend="inductor"))
