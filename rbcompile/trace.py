"""Capture a transformers model as an ATen-level torch.fx graph with torch.export."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CompileError

INPUT_NAMES = ("input_ids", "attention_mask")


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


def example_inputs(vocab_size: int, batch: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    """Inputs used for tracing: the sizes are irrelevant, batch and sequence stay dynamic."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, : seq // 4] = 0  # one padded row so the mask path is traced generally
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def trace(model: torch.nn.Module, family: str) -> TracedModel:
    """torch.export the model with dynamic batch and sequence, `use_cache=False`."""
    limit = max_positions(model.config)
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=limit)
    kwargs = example_inputs(model.config.vocab_size, seq=min(8, limit))
    dynamic = {name: {0: batch, 1: seq} for name in INPUT_NAMES}
    if family == "decoder":
        kwargs["use_cache"] = False
        dynamic["use_cache"] = None
    try:
        with torch.no_grad():
            exported = torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic,
                                           strict=False)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(f"torch.export failed for {type(model).__name__}: {first}") from None
    out_spec = exported.call_spec.out_spec
    names = list(out_spec.context) if isinstance(out_spec.context, list) else []
    if not names:
        names = [f"output_{i}" for i in range(out_spec.num_leaves)]
    return TracedModel(exported.module(), names, limit)
