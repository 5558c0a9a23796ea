"""Mark the skeleton: everything outside the transformer blocks always runs.

Requires: `ctx:blocks`, `rb_block`. Ensures `meta:rb_kind` ("skeleton" here; later passes
refine block nodes to "prunable" and shape-only skeleton nodes to "cache"). The skeleton holds the
embeddings, the residual stream between blocks, the final norm, the head, mask and position
computations, and shape arithmetic used across blocks.
"""
from __future__ import annotations

from collections import Counter

from torch.fx import GraphModule

from rbcompile.passes.base import (
    BLOCK,
    KIND,
    PassContext,
    PassReport,
    compute_nodes,
    graph_pass,
    module_path,
)


@graph_pass(requires=("ctx:blocks", "meta:rb_block"), ensures=("meta:" + KIND,))
def mark_skeleton(gm: GraphModule, ctx: PassContext) -> PassReport:
    modules: Counter[str] = Counter()
    for node in compute_nodes(gm):
        node.meta[KIND] = "skeleton" if node.meta[BLOCK] is None else "block"
        if node.meta[BLOCK] is None:
            path = module_path(node)
            modules["<shape arithmetic>" if not path or path.startswith("_") else path] += 1
    count = sum(modules.values())
    listed = ", ".join(sorted(modules))
    return PassReport(True, f"{count} skeleton nodes in modules: {listed}",
                      {"skeleton_nodes": count, "modules": sorted(modules)})
