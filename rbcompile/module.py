"""The generated module at run time: instantiate generated source, attach weights, compile its
regions. Used by the compiler and by artifact loading alike; imports nothing of the compiler
(loading an artifact never imports the passes)."""
from __future__ import annotations

import linecache

import torch

from .errors import UserError


def instantiate(source: str, tag: str, namespace: dict | None = None) -> torch.nn.Module:
    """Execute generated source (and only that) in `namespace` (default: a fresh one) and
    return an empty GeneratedModel."""
    filename = f"<rbcompile generated {tag}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "rbcompile_generated"} if namespace is None else namespace
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace["GeneratedModel"]()


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a generated module holds, by weight key (what `attach_weights` takes)."""
    return {key: module.get_buffer(name) for name, key in module.PARAMETERS.items()}


def attach_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Register each tensor named in module.PARAMETERS as a buffer; strict on missing keys."""
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
