"""Capture a transformers model as an ATen-level torch.fx graph with torch.export."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .errors import CompileError, first_line

INPUT_NAMES = ("input_ids", "attention_mask")
logger = logging.getLogger("rbcompile.trace")


@dataclass
class TracedModel:
    graph_module: torch.fx.GraphModule  # parameters as get_attr nodes, nn_module_stack in meta
    output_names: list[str]
    max_positions: int


def max_positions(config) -> int:
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4096


def example_inputs(vocab_size: int, batch: int = 2, seq: int = 8,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Inputs used for tracing: the sizes are irrelevant, batch and sequence stay dynamic."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, : seq // 4] = 0  # one padded row so the mask path is traced generally
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def model_placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, float dtype) of a model's parameters."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    first = floats[0] if floats else next(model.parameters())
    return first.device, first.dtype


def _export(model, kwargs, dims: dict, family: str):
    dynamic = {name: dict(dims) for name in INPUT_NAMES}
    if family == "decoder":
        kwargs = {**kwargs, "use_cache": False}
        dynamic["use_cache"] = None
    with torch.no_grad():
        return torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic, strict=False)


def trace(model: torch.nn.Module, family: str) -> TracedModel:
    """torch.export the model with dynamic batch and sequence, `use_cache=False`.

    Named dimensions (batch 1..4096, seq 1..max positions) first; where an older torch finds a
    narrower valid range than that (torch 2.11 on some decoders: "Constraints violated (seq)"),
    `Dim.DYNAMIC` lets export refine the range instead of failing, and the runtime's own input
    checks stay in force."""
    limit = max_positions(model.config)
    kwargs = example_inputs(model.config.vocab_size, seq=min(8, limit),
                            device=model_placement(model)[0])
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
    return TracedModel(exported.module(), names, limit)
