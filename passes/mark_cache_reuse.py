"""Mark cache-reuse nodes: skeleton tensors that depend only on input shapes, the attention mask
and parameters (position ids, rotary cos/sin, expanded attention masks, token-type rows).

Requires: `rb_kind`, `rb_deps`. Ensures `ctx:cache_candidates`; such nodes get
`rb_kind = "cache"`. Codegen serves them from a cache keyed by the input sizes (and a digest of
the attention mask when they read it). Content-keyed candidates that need the runtime (exact
repeats of whole requests, prefix K/V per attention layer) are listed, not rewritten.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from rbcompile.artifact.architectures import DECODER, all_kv_projections
from rbcompile.passes.base import (
    DEPS,
    KIND,
    PassContext,
    PassReport,
    compute_nodes,
    graph_pass,
    is_scalar,
    is_tensor,
    writes_input,
)


def _cacheable(node: Node) -> bool:
    return (node.meta[KIND] == "skeleton" and is_tensor(node)
            and not node.meta[DEPS] & {"data", "position"}
            and not any(writes_input(user) for user in node.users))


def _kv_parameters(ctx: PassContext) -> list[dict]:
    out = []
    parts = ctx.architecture.kv_projections if ctx.architecture else all_kv_projections()
    for unit in ctx.units:
        if unit.kind in ("attention", "layer") and ctx.family == DECODER:
            params = [p for p in unit.width["parameters"] if any(part in p for part in parts)]
            out.append({"unit": unit.name, "parameters": params})
    return out


def _closed(candidates: list[Node], ctx: PassContext) -> list[Node]:
    """The candidates whose tensor inputs are all keys (the mask input, sizes), parameters or
    other kept candidates: a cached value must be recomputable from its key alone. (A constant
    that a layer's module path claims, e.g. a lifted `torch.tensor(...)`, is not a candidate.)"""
    mask = ctx.architecture.mask_input if ctx.architecture else "attention_mask"
    kept = set(candidates)
    changed = True
    while changed:
        changed = False
        for node in list(kept):
            if any(not (inp in kept or inp.op == "get_attr" or is_scalar(inp)
                        or (inp.op == "placeholder" and inp.target == mask))
                   for inp in node.all_input_nodes):
                kept.discard(node)
                changed = True
    return [n for n in candidates if n in kept]


@graph_pass(requires=("meta:rb_kind", "meta:rb_deps"), ensures=("ctx:cache_candidates",))
def mark_cache_reuse(gm: GraphModule, ctx: PassContext) -> PassReport:
    marked = _closed([n for n in compute_nodes(gm) if _cacheable(n)], ctx)
    for node in marked:
        node.meta[KIND] = "cache"
    mask_keyed = sum(1 for n in marked if "mask" in n.meta[DEPS])
    ctx.cache_candidates = {
        "shape_keyed": {"nodes": len(marked), "mask_keyed_nodes": mask_keyed},
        "exact_repeat": {"key": list(ctx.input_names), "scope": "whole request"},
        "prefix_kv": _kv_parameters(ctx),
    }
    return PassReport(bool(marked), f"{len(marked)} nodes served from the shape-keyed cache "
                      f"({mask_keyed} also keyed by the attention mask)",
                      {"cache_nodes": len(marked), "mask_keyed_nodes": mask_keyed})
