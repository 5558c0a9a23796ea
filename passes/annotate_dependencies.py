"""Annotate what each value depends on: token data, the attention mask, or only shapes.

Requires: canonical graph. Ensures `meta:rb_deps` on every compute node: a frozenset of
"data" (depends on input_ids), "mask" (on attention_mask values), "position" (on the values of
position_ids / cache_position / token_type_ids, which torch.compile graphs may take as inputs)
and "shape" (on input sizes).
An empty set means the value depends on parameters and constants only. Size queries
(`sym_size` ...) depend on shapes only, whatever tensor they read the size of.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from rbcompile.passes.base import DEPS, PassContext, PassReport, compute_nodes, graph_pass

aten = torch.ops.aten
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int,
                 aten.sym_storage_offset.default}
_INPUT_DEPS = {"input_ids": frozenset({"data"}), "attention_mask": frozenset({"mask"}),
               **{name: frozenset({"position"})
                  for name in ("position_ids", "cache_position", "token_type_ids")}}


def _inputs(node: Node) -> list[Node]:
    return list(node.all_input_nodes)


@graph_pass(ensures=("meta:" + DEPS,))
def annotate_dependencies(gm: GraphModule, ctx: PassContext) -> PassReport:
    counts = {"data": 0, "mask": 0, "position": 0, "shape-only": 0, "constant": 0}
    for node in gm.graph.nodes:
        if node.op == "placeholder":  # a symbolic size (torch.compile graphs) is a shape
            node.meta[DEPS] = (frozenset({"shape"}) if isinstance(node.meta.get("val"), torch.SymInt)
                               else _INPUT_DEPS.get(node.target, frozenset({"data"})))
        elif node.op == "get_attr":
            node.meta[DEPS] = frozenset()
        elif node.op == "call_function":
            if node.target in _SIZE_QUERIES:
                deps = frozenset({"shape"})
            else:
                deps = frozenset().union(*(n.meta[DEPS] for n in _inputs(node)))
            node.meta[DEPS] = deps
            if "data" in deps:
                counts["data"] += 1
            elif "mask" in deps:
                counts["mask"] += 1
            elif "position" in deps:
                counts["position"] += 1
            elif deps:
                counts["shape-only"] += 1
            else:
                counts["constant"] += 1
    total = len(compute_nodes(gm))
    return PassReport(True, f"{total} nodes: " + ", ".join(f"{v} {k}" for k, v in counts.items()),
                      counts)
