"""Mark prunable units: whole layers, or the attention and MLP residual branches of pre-LN layers.

Requires: `ctx:blocks`, `rb_kind`. Ensures `ctx:units`; every block node gets
`rb_kind = "prunable"` and `rb_unit`. Skipping a unit is an identity on the residual stream
(stream_out := stream_in), which discover_blocks has checked: each unit reads the stream from
outside and exports only its residual add. Width units (attention heads, MLP channels) are
recorded with the parameters they live in, for elastic width. A branch or layer that writes the
KV cache (graph outputs besides the stream) must always run: it stays skeleton.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from rbcompile.artifact.architectures import Dimensions
from rbcompile.passes.base import (
    KIND,
    UNIT,
    PassContext,
    PassReport,
    Unit,
    compute_nodes,
    graph_pass,
    module_path,
)

aten = torch.ops.aten
_ATTENTION = {aten.scaled_dot_product_attention.default, aten._softmax.default,
              aten.softmax.int}


def _parameters(nodes: list[Node]) -> list[str]:
    found = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp.op == "get_attr":
                found[inp.target] = None
    return list(found)


_MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}


def _out_projections(kind: str, nodes: list[Node]) -> dict[str, str]:
    """Module paths of the projections whose inputs are the heads (the first matmul with a
    weight after the attention op: eager attention's `weights @ V` has none, Gemma 2) and the MLP
    channels (the last matmul of the unit)."""
    matmuls = [i for i, n in enumerate(nodes) if n.target in _MATMULS
               and any(a.op == "get_attr" for a in n.all_input_nodes)]
    attention = [i for i, n in enumerate(nodes) if n.target in _ATTENTION]
    out = {}
    if kind in ("attention", "layer") and attention:
        after = [i for i in matmuls if i > attention[-1]]
        if after:
            out["attention_out"] = module_path(nodes[after[0]])
    if kind in ("mlp", "layer") and matmuls:
        out["mlp_out"] = module_path(nodes[matmuls[-1]])
    return out


def _width(kind: str, dims: Dimensions | None, nodes: list[Node]) -> dict:
    """Head / channel counts (from the model's dimensions; none for a graph from torch.compile,
    which has no config and no width levels) and the parameters they live in."""
    width = {}
    if kind in ("attention", "layer") and dims is not None:
        width.update(heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim)
    if kind in ("mlp", "layer") and dims is not None:
        width["channels"] = dims.channels
    width["parameters"] = _parameters(nodes)
    width.update(_out_projections(kind, nodes))
    return width


@graph_pass(requires=("ctx:blocks", "meta:rb_kind"), ensures=("ctx:units",))
def mark_prunable(gm: GraphModule, ctx: PassContext) -> PassReport:
    units, cache_writers = [], []
    for block in ctx.blocks:
        if block.branches:
            for branch in block.branches:
                if branch.cache_outputs:
                    cache_writers.append(branch.nodes)
                    continue
                units.append(Unit(f"{block.module_path}.{branch.name}", branch.kind, block.index,
                                  branch.module_path, branch.nodes, branch.stream_in,
                                  branch.stream_out,
                                  _width(branch.kind, ctx.dims, branch.nodes)))
        elif block.cache_outputs:
            cache_writers.append(block.nodes)
        else:
            units.append(Unit(block.module_path, "layer", block.index, block.module_path,
                              block.nodes, block.stream_in, block.stream_out,
                              _width("layer", ctx.dims, block.nodes)))
    for unit in units:
        for node in unit.nodes:
            node.meta[KIND] = "prunable"
            node.meta[UNIT] = unit.name
    for nodes in cache_writers:
        for node in nodes:
            node.meta[KIND] = "skeleton"
    leftover = [n.name for n in compute_nodes(gm) if n.meta[KIND] == "block"]
    if leftover:
        raise AssertionError(f"block nodes outside every unit: {leftover[:5]}")
    kinds = sorted({u.kind for u in units})
    ctx.units = units
    kept = f"; {len(cache_writers)} kept in the skeleton (they write the KV cache)" \
        if cache_writers else ""
    return PassReport(True, f"{len(units)} prunable units ({', '.join(kinds)}) over "
                      f"{len(ctx.blocks)} layers{kept}",
                      {"units": len(units), "kinds": kinds, "cache_writers": len(cache_writers)})
