"""One additive attention mask per mask and dtype, not one per layer (an exact rewrite).

Scaled dot-product attention turns a bool `attn_mask` into an additive one in the query's dtype
at every call (`where(mask, 0, -inf)` over two scalar tensors: three ops), so a model whose
layers share one mask converts it once per layer and call: on a GPU three kernel launches per
layer (90 per decode step at 30 layers). Here the conversion is made once, where the mask is,
and every attention of that mask and dtype reads it.

Two forms: `scaled_dot_product_attention` reading a bool mask (torch.export graphs), and
aot_autograd's decomposed attention (`_scaled_dot_product_*_attention` reading its own
`where(mask, scalar_tensor, scalar_tensor)`: the torch.compile backend). Either way one
conversion, the same ops with the same values, is made right after the mask (with the mask's
module, so no layer exports it to the others) and read by every attention of that mask, dtype
and values; aot_autograd's own conversions are dropped. Masks are one mask when their views
match. A mask made inside a numbered layer (a per-layer view, say) or not computed in the graph
(an input) is left alone: the conversion would belong to that layer, or to no module.

Requires: nothing (after canonicalize). Ensures: the graph computes the same values; no two
attentions convert one mask each on their own.
"""
from __future__ import annotations

import contextlib
import re

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from rbcompile.passes.base import (
    PassContext,
    PassReport,
    erase_unused,
    graph_pass,
    module_path,
    structure,
    tensor_val,
)

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
# where each attention op takes its mask: (position, keyword)
_MASK_ARG = {_SDPA: (3, "attn_mask"),
             aten._scaled_dot_product_flash_attention_for_cpu.default: (None, "attn_mask"),
             aten._scaled_dot_product_efficient_attention.default: (3, "attn_bias"),
             aten._scaled_dot_product_cudnn_attention.default: (3, "attn_bias")}


def _get_mask(node: Node):
    position, keyword = _MASK_ARG[node.target]
    if position is not None and len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword)


def _set_mask(node: Node, mask: Node) -> None:
    position, keyword = _MASK_ARG[node.target]
    if position is not None and len(node.args) > position:
        node.args = (*node.args[:position], mask, *node.args[position + 1:])
    else:
        node.kwargs = {**node.kwargs, keyword: mask}


def _is_view(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _scalar(node) -> tuple | None:
    """(value, dtype) of a `scalar_tensor` node, else None."""
    if isinstance(node, Node) and node.target is aten.scalar_tensor.default:
        return node.args[0], node.kwargs.get("dtype")
    return None


def _conversion(attention: Node) -> tuple[Node, torch.dtype, tuple] | None:
    """(bool mask, dtype, (value where True, value where False)) of the additive mask that
    `attention` reads (aot_autograd's `where`) or makes itself (SDPA of a bool mask), or None."""
    mask, query = _get_mask(attention), tensor_val(attention.args[0])
    if isinstance(mask, Node) and mask.target is aten.where.self:
        scalars = [_scalar(arg) for arg in mask.args[1:3]]
        if None in scalars or scalars[0][1] is None or scalars[0][1] != scalars[1][1]:
            return None
        return mask.args[0], scalars[0][1], (scalars[0][0], scalars[1][0])
    if (attention.target is _SDPA and query is not None and tensor_val(mask) is not None
            and tensor_val(mask).dtype == torch.bool):
        return mask, query.dtype, (0.0, float("-inf"))
    return None


def _outside_layers(node: Node) -> bool:
    """Not made inside a numbered layer (a conversion there would be read by the others)."""
    return re.search(r"\.\d+(\.|$)", module_path(node)) is None


def _convert(graph, mask: Node, dtype: torch.dtype, values: tuple) -> Node:
    """`where(mask, values[0], values[1])` in `dtype`, right after `mask` (with its module)."""
    meta = {k: v for k, v in mask.meta.items() if k != "val"}
    mask_val = tensor_val(mask)
    mode = detect_fake_mode([mask_val])
    scalars, anchor = [], mask
    for value in values:
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.scalar_tensor.default, (value,),
                                         {"dtype": dtype, "device": mask_val.device})
        scalars.append(anchor)
    with graph.inserting_after(anchor):
        additive = graph.call_function(aten.where.self, (mask, *scalars))
    with mode if mode is not None else contextlib.nullcontext():
        vals = [aten.scalar_tensor.default(n.args[0], **n.kwargs) for n in scalars]
        additive.meta["val"] = aten.where.self(mask_val, *vals)
    for node, val in zip(scalars, vals):
        node.meta.update(meta, val=val)
    additive.meta.update(meta)
    return additive


@graph_pass()
def share_attention_masks(gm: GraphModule, ctx: PassContext) -> PassReport:
    graph = gm.graph
    shared: dict[tuple, Node] = {}   # (mask structure, dtype, values) -> the one conversion
    rewired = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MASK_ARG:
            continue
        found = _conversion(node)
        if (found is None or found[0].op != "call_function" or tensor_val(found[0]) is None
                or not _outside_layers(found[0])):
            continue
        mask, dtype, values = found
        key = (structure(mask, _is_view), dtype, values)  # one mask when its views match
        if key not in shared:
            shared[key] = _convert(graph, mask, dtype, values)
        old = _get_mask(node)
        _set_mask(node, shared[key])
        if old is not mask:  # aot_autograd's own conversion, now unread
            erase_unused(old)
        rewired += 1
    gm.recompile()
    return PassReport(rewired > 0, f"{rewired} attentions read {len(shared)} additive masks, "
                      "each converted once", {"attentions": rewired, "masks": len(shared)})
