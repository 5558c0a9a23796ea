"""One matmul for the projections that read the same input: q / k / v, gate / up.

At decode sizes every projection is a kernel launch of its own, and a small one: a Llama layer
runs seven. Projections of one input are one matmul against their weights stacked by rows
(gpt-fast's `wqkv`, vLLM's `QKVParallelLinear`); each projection's output is then a slice of the
last dimension of the stacked output (a view), read where the projection's output was read.

The stacked weight is not a second copy: the pass records it in `ctx.concatenated` (stacked
key -> the keys of its parts), and `rbcompile.artifact.module.attach_weights` stacks the parts once when
weights are attached and makes each part a view of the stack, for every module that reads it.
So the stack always holds the weights the parts hold (permuted ones included), an artifact
stores the parts as before, and narrower width variants read views of the parts. Runs only
with `ctx.fuse_projections` (by default where the model is compiled on CUDA; on CPU it
measured no faster: benchmarks/bench_stacking.py), last (`LAYOUT_PIPELINE`): on the main
graph after calibration has permuted its weights, and on the KV-cached decoder graph.

A group is fused when its linears read one input, take their weights (and all or none of them a
bias) as graph constants of one dtype and input width, lie in one region with every reader of
their outputs, and every reader takes a strided slice (a `view` only when it splits the last
dimension, as attention's `[B, T, heads, head_dim]` does).

Requires: `ctx:regions`. Ensures: the graph computes the same values up to matmul rounding;
fused nodes keep the region, kind and unit of the projections they replace.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch.fx import GraphModule, Node

from rbcompile.passes.base import (
    FLOPS,
    REGION,
    SHAPE,
    PassContext,
    PassReport,
    graph_pass,
    tensor_val,
)

aten = torch.ops.aten
_LINEAR = aten.linear.default
_SHAPED_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _constant(gm: GraphModule, node) -> torch.Tensor | None:
    if isinstance(node, Node) and node.op == "get_attr":
        parent, _, name = node.target.rpartition(".")
        value = getattr(gm.get_submodule(parent), name, None)
        return value if isinstance(value, torch.Tensor) else None
    return None


def _reads_a_slice(user: Node, width: int) -> bool:
    """Whether `user` computes the same from a last-dimension slice of a wider output as from
    the contiguous output: any op but a graph output, `as_strided`, or a `view` that does more
    than split the last dimension (its trailing sizes must multiply to `width`)."""
    if user.op != "call_function" or user.target is aten.as_strided.default:
        return False
    if user.target not in _SHAPED_VIEWS:
        return True
    shape, product = tensor_val(user).shape if tensor_val(user) is not None else (), 1
    for size in reversed(shape):
        if not isinstance(size, int):
            return False
        product *= size
        if product >= width:
            return product == width
    return False


def _projection(gm: GraphModule, node: Node) -> tuple | None:
    """(input, weight, bias or None) of a linear over constants whose readers take a slice."""
    if node.op != "call_function" or node.target is not _LINEAR or node.kwargs:
        return None
    x, weight, bias = (*node.args, None)[:3]
    w = _constant(gm, weight)
    if w is None or w.dim() != 2 or (bias is not None and _constant(gm, bias) is None):
        return None
    region = node.meta.get(REGION)
    if any(user.meta.get(REGION) != region or not _reads_a_slice(user, w.shape[0])
           for user in node.users):
        return None
    return x, weight, bias


def _stacked_key(targets: list[str]) -> str | None:
    """`a.b.q_proj.weight`, `a.b.k_proj.weight` -> `a.b.q_proj_k_proj_weight` (one parent and
    attribute), else None."""
    parts = [("", "", *target.rsplit(".", 2))[-3:] for target in targets]
    if any("" in p[1:] for p in parts) or len({(p[0], p[2]) for p in parts}) != 1:
        return None
    parent, attr = parts[0][0], parts[0][2]
    return f"{parent}{'.' if parent else ''}{'_'.join(p[1] for p in parts)}_{attr}"


def _taken(gm: GraphModule, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    return hasattr(gm.get_submodule(parent), name)


def _stack(gm: GraphModule, anchor: Node, nodes: list[Node], key: str) -> Node:
    """A get_attr of the rows of `nodes`' constants stacked, registered under `key`."""
    parent, _, name = key.rpartition(".")
    gm.get_submodule(parent).register_buffer(
        name, torch.cat([_constant(gm, node).detach() for node in nodes]))
    with gm.graph.inserting_before(anchor):
        return gm.graph.get_attr(key)


def _fuse(gm: GraphModule, linears: list[Node], ctx: PassContext) -> bool:
    weights = [linear.args[1] for linear in linears]
    biases = [linear.args[2] if len(linear.args) > 2 else None for linear in linears]
    keys = [_stacked_key([n.target for n in weights]),
            _stacked_key([n.target for n in biases]) if biases[0] is not None else None]
    if (keys[0] is None or (biases[0] is not None and keys[1] is None)
            or any(key is not None and _taken(gm, key) for key in keys)):
        return False
    graph, first = gm.graph, linears[0]
    stacked = [_stack(gm, first, weights, keys[0])]
    if biases[0] is not None:
        stacked.append(_stack(gm, first, biases, keys[1]))
    for key, parts in zip(keys, (weights, biases)):
        if key is not None:
            ctx.concatenated[key] = [node.target for node in parts]
    with graph.inserting_before(first):
        fused = graph.call_function(_LINEAR, (first.args[0], *stacked))
    vals = [tensor_val(linear) for linear in linears]
    fused.meta.update({k: v for k, v in first.meta.items() if k not in ("val", SHAPE)},
                      **{FLOPS: sum(linear.meta.get(FLOPS, 0) for linear in linears)})
    if all(v is not None for v in vals):
        fused.meta["val"] = torch.cat(vals, -1)
    if all(SHAPE in linear.meta for linear in linears):
        shape = first.meta[SHAPE]
        fused.meta[SHAPE] = (*shape[:-1], sum(linear.meta[SHAPE][-1] for linear in linears))
    start, anchor = 0, fused
    for linear in linears:
        width = _constant(gm, linear.args[1]).shape[0]
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + width))
        anchor.meta.update(linear.meta, **{FLOPS: 0})
        linear.replace_all_uses_with(anchor)
        graph.erase_node(linear)
        start += width
    for node in [*weights, *biases]:
        if node is not None and not node.users:
            graph.erase_node(node)
    return True


@graph_pass(requires=("ctx:regions",))
def fuse_projections(gm: GraphModule, ctx: PassContext) -> PassReport:
    if not ctx.fuse_projections:
        return PassReport(False, "off (only the KV-cached decoder's projections are stacked)")
    groups: dict[tuple, list[Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        found = _projection(gm, node)
        if found is not None:
            x, weight, bias = found
            w = _constant(gm, weight)
            groups[(x, w.dtype, w.device, w.shape[1], bias is None, node.meta.get(REGION))].append(node)
    fused = [linears for linears in groups.values() if len(linears) > 1 and _fuse(gm, linears, ctx)]
    gm.graph.lint()
    gm.recompile()
    sizes = Counter(len(linears) for linears in fused)
    removed = sum(len(linears) - 1 for linears in fused)
    detail = ", ".join(f"{count} of {size}" for size, count in sorted(sizes.items()))
    return PassReport(bool(fused), f"stacked {len(fused)} groups of projections "
                      f"({detail or 'none found'}): {removed} fewer matmuls",
                      {"groups": len(fused), "matmuls_removed": removed})
