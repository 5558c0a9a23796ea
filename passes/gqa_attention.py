"""Attention over grouped key / value heads without copying them in the graph (an exact
rewrite).

Requires: nothing (right after canonicalize). Ensures: no `scaled_dot_product_attention` reads
keys or values through transformers' `repeat_kv` (`unsqueeze(x, 2) -> expand -> reshape`,
which copies the whole K/V, the entire cache in a decode step, for every layer and call); such
an attention reads `x` itself with `enable_gqa=True`, which computes the same values (each
query head attends to its group's key / value head). The generated module runs every such
attention through rbcompile/artifact/attention.py `grouped_attention`, which picks the form per call
and device: SDPA's own grouped heads (CPU: 1.07-3.4x faster than the copies and the attention
after them, benchmarks/bench_gqa.py), the group's queries folded onto their K/V head (a decode
step with its mask, CUDA and 16-bit CPU), or, on CUDA where folding does not pay, the copies
(the fused kernel that takes a mask takes no grouped heads there).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from rbcompile.passes.base import PassContext, PassReport, erase_unused, graph_pass

aten = torch.ops.aten
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_ATTENTION = aten.scaled_dot_product_attention.default
_END = 2 ** 63 - 1   # a slice's end "to the end of the dimension"


def _past_whole_slices(node):
    """`node`, or what it slices when it is a slice that keeps all of its dimension (torch
    2.11 traces repeat_kv's `x[:, :, None, :, :]` as an unsqueeze and such a slice)."""
    while (isinstance(node, Node) and node.target is aten.slice.Tensor and not node.kwargs
           and tuple(node.args[2:]) in ((), (0,), (None,), (0, _END), (None, _END), (0, _END, 1))):
        node = node.args[0]
    return node


def _grouped_source(node) -> tuple[Node, int] | None:
    """(x, group) when `node` is repeat_kv(x): x [B, KV, L, D] unsqueezed at 2, expanded to
    [B, KV, group, L, D] and reshaped to [B, KV * group, L, D]; else None."""
    if not isinstance(node, Node) or node.target not in _RESHAPES:
        return None
    expand = node.args[0]
    if not isinstance(expand, Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = _past_whole_slices(expand.args[0])
    if (not isinstance(unsqueeze, Node) or unsqueeze.target is not aten.unsqueeze.default
            or unsqueeze.args[1] != 2 or len(expand.args[1]) != 5):
        return None
    group = expand.args[1][2]
    return (unsqueeze.args[0], group) if isinstance(group, int) and group > 1 else None


@graph_pass()
def gqa_attention(gm: GraphModule, ctx: PassContext) -> PassReport:
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target is not _ATTENTION or node.kwargs.get("enable_gqa"):
            continue
        key, value = (_grouped_source(arg) for arg in node.args[1:3])
        if key is None or value is None or key[1] != value[1]:
            continue
        old_key, old_value = node.args[1:3]
        node.args = (node.args[0], key[0], value[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        erase_unused(old_key)
        erase_unused(old_value)
        rewritten += 1
    gm.recompile()
    return PassReport(rewritten > 0, f"{rewritten} attentions read grouped K/V heads in place "
                      "(enable_gqa) instead of repeated copies", {"rewritten": rewritten})
