"""Reorder attention heads and MLP channels by descending importance (an exact rewrite).

Requires: `ctx:units`, `ctx:width_importance` (per unit: "heads" and/or "channels" scores).
Ensures: `ctx:permutations`. Every parameter that holds heads or channels is permuted in place
along the right axis (q/k/v rows and the output projection's columns; gate/up rows and the down
projection's columns; GPT-2's fused c_attn and Phi-3's qkv_proj / gate_up_proj per block).
GQA-aware: key/value groups move with their query heads. The function is unchanged (fp32 within
1e-5), and afterwards keeping the top-k heads or channels is a contiguous slice.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from rbcompile.artifact.architectures import CHANNELS, KV_HEADS, QUERY_HEADS
from rbcompile.errors import CompileError
from rbcompile.passes.base import PassContext, PassReport, graph_pass


def head_orders(scores: list[float], kv_heads: int) -> tuple[list[int], list[int]]:
    """(query head order, key/value head order): KV groups by summed score, descending, each
    followed by its own query heads (also by score)."""
    heads = len(scores)
    group = heads // kv_heads
    group_score = [sum(scores[g * group:(g + 1) * group]) for g in range(kv_heads)]
    kv_order = sorted(range(kv_heads), key=lambda g: -group_score[g])
    q_order = [h for g in kv_order
               for h in sorted(range(g * group, (g + 1) * group), key=lambda h: -scores[h])]
    return q_order, kv_order


def _expand(order: list[int], unit_size: int, blocks: int) -> torch.Tensor:
    """Index of rows/columns for an order of units of `unit_size`, repeated per fused block."""
    per_block = torch.tensor([u * unit_size + i for u in order for i in range(unit_size)])
    stride = len(order) * unit_size
    return torch.cat([per_block + b * stride for b in range(blocks)])


def _expand_blocks(orders: list[list[int]], unit_size: int) -> torch.Tensor:
    """Index of rows/columns of fused blocks side by side, each in its own order (Phi-3's
    qkv_proj: the query heads' order, then the KV heads' order twice)."""
    parts, offset = [], 0
    for order in orders:
        parts.append(_expand(order, unit_size, 1) + offset)
        offset += len(order) * unit_size
    return torch.cat(parts)


@graph_pass(requires=("ctx:units", "ctx:width_importance"), ensures=("ctx:permutations",))
def permute_width(gm: GraphModule, ctx: PassContext) -> PassReport:
    if ctx.architecture is None:
        raise CompileError("permuting heads and channels needs the model's architecture record")
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    permutations, moved = {}, 0
    for unit in ctx.units:
        scores = ctx.width_importance.get(unit.name, {})
        block_path = ctx.blocks[unit.layer].module_path
        orders = {}
        if "heads" in scores:
            orders[QUERY_HEADS], orders[KV_HEADS] = head_orders(scores["heads"],
                                                                unit.width["kv_heads"])
        if "channels" in scores:
            orders[CHANNELS] = sorted(range(len(scores["channels"])),
                                        key=lambda c: -scores["channels"][c])
        for part in ("heads", "channels"):
            if part not in scores:
                continue
            found = 0
            for param in ctx.architecture.width_parameters(part):
                name = f"{block_path}.{param.suffix}"
                if name not in params:
                    continue
                unit_size = 1 if param.space == CHANNELS else unit.width["head_dim"]
                index = _expand_blocks([orders[space] for space in param.layout], unit_size)
                tensor = operator.attrgetter(name)(gm)
                with torch.no_grad():
                    tensor.copy_(tensor.index_select(param.axis, index))
                found += 1
            if found < 2:
                raise CompileError(f"{unit.name}: parameters for its {part} not found under "
                                   f"{block_path}")
            moved += found
        permutations[unit.name] = {k: v for k, v in orders.items()}
    ctx.permutations = permutations
    return PassReport(bool(permutations), f"reordered heads/channels of {len(permutations)} units "
                      f"by importance ({moved} parameters permuted in place)",
                      {"units": len(permutations), "parameters": moved})
