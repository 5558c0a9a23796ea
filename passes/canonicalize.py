"""Canonicalize the exported graph: drop export guards, runtime asserts and identity ops.

Requires: a graph from torch.export (`ExportedProgram.module()`).
Ensures: no `_guards_fn` call, no `_assert_*` nodes, no eval-mode dropout, no aliasing or
same-dtype/same-device casts, only the model inputs as placeholders, and an `nn_module_stack` on
every compute node that has a computed neighbour: a node that a decomposition created without one
(aot_autograd's `add(x, eps)` of a 0-dim tensor, say) takes its inputs' module when they agree,
else its users'. Values are unchanged: every removed node is an identity or a check (input shapes
are validated by the runtime instead).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule, Node

from rbcompile.passes.base import PassContext, PassReport, graph_pass, module_path, writes_input

aten = torch.ops.aten

_CHECKS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
           aten.sym_constrain_range_for_size.default}
_CASTS = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default}


def _identity_input(node: Node) -> Node | None:
    """The input a node is an identity of, or None."""
    if node.target is aten.alias.default:
        return node.args[0]
    if node.target is aten.dropout.default:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return node.args[0] if train is False or node.args[1] == 0 else None
    if node.target in _CASTS and node.target is not aten._to_copy.default:
        source, val = node.args[0], node.meta.get("val")
        src_val = source.meta.get("val") if isinstance(source, Node) else None
        copy = node.kwargs.get("copy", False)
        memory_format = node.kwargs.get("memory_format")
        if (isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) and not copy
                and memory_format in (None, torch.preserve_format)
                and val.dtype == src_val.dtype and val.device == src_val.device):
            return source
    return None


def _stack_of(nodes) -> dict | None:
    """The one nn_module_stack the compute nodes among `nodes` share (by module path), or None."""
    stacks = {}
    for node in nodes:
        stack = node.meta.get("nn_module_stack") if node.op == "call_function" else None
        if stack:
            stacks[module_path(node)] = stack
    return next(iter(stacks.values())) if len(stacks) == 1 else None


def _inherit_module_stacks(graph) -> int:
    """Give compute nodes without an nn_module_stack their inputs' (or else their users') stack."""
    inherited = 0
    for order, neighbours in ((list(graph.nodes), lambda n: n.all_input_nodes),
                              (list(reversed(graph.nodes)), lambda n: list(n.users))):
        for node in order:
            if node.op == "call_function" and not node.meta.get("nn_module_stack"):
                stack = _stack_of(neighbours(node))
                if stack is not None:
                    node.meta["nn_module_stack"] = dict(stack)
                    inherited += 1
    return inherited


@graph_pass(ensures=())
def canonicalize(gm: GraphModule, ctx: PassContext) -> PassReport:
    removed: Counter[str] = Counter()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
            removed["export guards"] += 1
        elif node.op == "call_function" and node.target in _CHECKS:
            graph.erase_node(node)
            removed["runtime asserts"] += 1
        elif node.op == "call_function" and (source := _identity_input(node)) is not None:
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            removed[f"identity {node.target}"] += 1
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.target not in ctx.input_names:
            if node.users:
                raise AssertionError(f"extra model input {node.target!r} is still used")
            graph.erase_node(node)
            removed["unused inputs"] += 1
    before = len(graph.nodes)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or writes_input(n))
    removed["module paths inherited"] = _inherit_module_stacks(graph)
    removed["dead nodes"] += before - len(graph.nodes)
    gm.recompile()
    total = sum(removed.values())
    detail = ", ".join(f"{v} {k}" for k, v in sorted(removed.items()) if v)
    return PassReport(total > 0, f"removed {total} nodes ({detail})", dict(removed))
