"""Mark seams: a residual add that ends one region and the fused norm that starts the next.

In a pre-LN model the residual add `h + f` closes a branch's region and the norm of the next
branch opens the next region, so fuse_kernels (which fuses within one region only) leaves them
apart: two kernels and one more trip of the residual stream through memory at every guard.
When both regions run at full width, codegen's seam methods (codegen.py) fuse them: the first
region returns `h` and `f` unadded, the next adds them inside `add_rms_norm` / `add_layer_norm`
and goes on with the sum; the region interpreter (regions.py) picks those methods only then, so
a skipped region keeps its identity and a narrowed one its own method.

Requires: `ctx:regions` and fuse_kernels before it (it looks for the fused norms). Runs only
with `ctx.kernels`. Ensures: the graph is unchanged; region i carries `seam` = {"add": the sum
it outputs, "residual": h, "branch": f, "norm": the norm in region i + 1 that reads the sum}.
A sum is a seam only when region i + 1 alone reads it, reads it first through that norm, and
the graph's outputs do not include it.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from rbcompile.artifact.ir import ADD_NORMS, op_name
from rbcompile.passes.base import REGION, PassContext, PassReport, graph_pass

aten = torch.ops.aten


def _residual_add(node: Node) -> bool:
    """`node` is `a + b` of two tensors of its own shape and dtype (no alpha, no broadcast)."""
    if not (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2
            and not node.kwargs and all(isinstance(a, Node) for a in node.args)):
        return False
    vals = [n.meta.get("val") for n in (node, *node.args)]
    return (all(isinstance(v, torch.Tensor) for v in vals)
            and all(v.shape == vals[0].shape and v.dtype == vals[0].dtype for v in vals[1:]))


def _seam(nodes: dict[str, Node], region: dict, following: dict, order: dict) -> dict | None:
    """The seam between `region` and the region after it, or None (`nodes`: the graph's by
    name, `order`: their positions)."""
    if region["kind"] not in ("skeleton", "prunable") or following["kind"] not in ("skeleton",
                                                                                  "prunable"):
        return None
    for name in region["outputs"]:
        add = nodes.get(name)
        if add is None or add.meta.get(REGION) != region["id"] or not _residual_add(add):
            continue
        if region["kind"] == "prunable" and region["skip"].get(name) is None:
            continue
        readers = list(add.users)
        if any(user.op != "call_function" or user.meta.get(REGION) != following["id"]
               for user in readers):
            continue
        first = min(readers, key=order.__getitem__)
        if (isinstance(first.target, torch._ops.OpOverload) and op_name(first.target) in ADD_NORMS
                and first.args[0] is add and add not in first.args[1:]):
            residual, branch = add.args
            return {"add": add.name, "residual": residual.name, "branch": branch.name,
                    "norm": first.name}
    return None


@graph_pass(requires=("ctx:regions",))
def mark_seams(gm: GraphModule, ctx: PassContext) -> PassReport:
    if not ctx.kernels:
        return PassReport(False, "off (fused kernels not requested)")
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    nodes = {node.name: node for node in order}
    marked = []
    for region, following in zip(ctx.regions, ctx.regions[1:]):
        region.pop("seam", None)
        seam = _seam(nodes, region, following, order)
        if seam is not None:
            region["seam"] = seam
            marked.append(f"{region['id']}->{following['id']}")
    detail = f" (regions {', '.join(marked)})" if marked else ""
    return PassReport(bool(marked), f"marked {len(marked)} seams: a residual add fused into the "
                      f"next region's norm when both run{detail}", {"seams": len(marked)})
