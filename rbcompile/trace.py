"""Capture a transformers model as an ATen-level torch.fx graph with torch.export."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .architectures import DECODER, Architecture
from .errors import CompileError, first_line

logger = logging.getLogger("rbcompile.trace")


@dataclass
class TracedModel:
    graph_module: torch.fx.GraphModule  # parameters as get_attr nodes, nn_module_stack in meta
    input_names: tuple[str, ...]
    output_names: list[str]
    max_positions: int


def example_inputs(architecture: Architecture, vocab_size: int, batch: int = 2, seq: int = 8,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Inputs used for tracing (the token ids, then the attention mask, under the
    architecture's input names): the sizes are irrelevant, batch and sequence stay dynamic."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, : seq // 4] = 0  # one padded row so the mask path is traced generally
    ids_name, = (name for name in architecture.inputs if name != architecture.mask_input)
    return {ids_name: input_ids.to(device), architecture.mask_input: attention_mask.to(device)}


def model_placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, float dtype) of a model's parameters."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    first = floats[0] if floats else next(model.parameters())
    return first.device, first.dtype


def _export(model, kwargs, dims: dict, family: str):
    dynamic = {name: dict(dims) for name in kwargs}
    if family == DECODER:
        kwargs = {**kwargs, "use_cache": False}
        dynamic["use_cache"] = None
    with torch.no_grad():
        return torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic, strict=False)


def trace(model: torch.nn.Module, architecture: Architecture) -> TracedModel:
    """torch.export the model with dynamic batch and sequence, `use_cache=False`.

    Named dimensions (batch 1..4096, seq 1..max positions) first; where an older torch finds a
    narrower valid range than that (torch 2.11 on some decoders: "Constraints violated (seq)"),
    `Dim.DYNAMIC` lets export refine the range instead of failing, and the runtime's own input
    checks stay in force."""
    dims = architecture.dimensions(model.config)
    limit, family = dims.max_positions, architecture.family
    kwargs = example_inputs(architecture, dims.vocab, seq=min(8, limit),
                            device=model_placement(model)[0])
    kwargs = {name: kwargs[name] for name in architecture.inputs}
    named = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("seq", min=1, max=limit)}
    try:
        try:
            exported = _export(model, kwargs, named, family)
        except Exception as exc:
            if "Constraints violated" not in str(exc):
                raise
            logger.warning("torch.export: %s; retrying with Dim.DYNAMIC",
                           " ".join(str(exc).split())[:300])
            exported = _export(model, kwargs, {0: torch.export.Dim.DYNAMIC,
                                               1: torch.export.Dim.DYNAMIC}, family)
            logger.warning("torch.export ranges: %s", exported.range_constraints)
    except Exception as exc:
        first = first_line(exc)
        raise CompileError(f"torch.export failed for {type(model).__name__}: {first}") from None
    out_spec = exported.call_spec.out_spec
    names = list(out_spec.context) if isinstance(out_spec.context, list) else []
    if not names:
        names = [f"output_{i}" for i in range(out_spec.num_leaves)]
    return TracedModel(exported.module(), architecture.inputs, names, limit)
