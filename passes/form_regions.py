"""Order the graph and cut it into regions: contiguous runs of one kind (and one prunable unit).

Requires: `rb_kind`, `ctx:units`. Ensures `ctx:regions` and `meta:rb_region`.
Shape arithmetic moves as early as its inputs allow, then the cache-reuse nodes, so that each
forms one region at the start; everything else keeps its traced order. Each prunable unit must
come out as exactly one region whose only exported value is its residual add, and whose skip
value is the stream it reads: the region contract codegen relies on.
"""
from __future__ import annotations

import heapq
from collections import Counter

from torch.fx import GraphModule, Node

from rbcompile.errors import CompileError
from rbcompile.passes.base import (
    FLOPS,
    KIND,
    REGION,
    UNIT,
    PassContext,
    PassReport,
    graph_pass,
    is_scalar,
    module_path,
)


def _priority(node: Node) -> int:
    if node.op in ("placeholder", "get_attr"):
        return 0
    if node.op == "output":
        return 4
    if node.meta[KIND] != "prunable" and is_scalar(node):
        return 1
    return 2 if node.meta[KIND] == "cache" else 3


def _reorder(gm: GraphModule) -> list[Node]:
    """Stable topological order by (priority, traced position); moves the nodes in place."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(_priority(n), position[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (_priority(user), position[user], user))
    assert len(order) == len(nodes), "graph has a cycle"
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)
    gm.graph.lint()
    return order


def _region_key(node: Node) -> tuple:
    kind = node.meta[KIND]
    return (kind, node.meta[UNIT]) if kind == "prunable" else (kind,)


def _io(nodes: list[Node], position: dict[Node, int]) -> tuple[list[Node], list[Node]]:
    """(values read from outside, values used outside), in graph order."""
    members = set(nodes)
    reads, exports = {}, {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in members and inp.op != "get_attr":
                reads[inp] = None
        if any(user not in members for user in node.users):
            exports[node] = None
    return sorted(reads, key=position.__getitem__), list(exports)


def _skeleton_name(nodes: list[Node]) -> str:
    paths = Counter(module_path(n) for n in nodes
                    if module_path(n) and not module_path(n).startswith("_") and not is_scalar(n))
    if not paths:
        return "shapes"
    return "+".join(p for p, _ in sorted(paths.most_common(3), key=lambda kv: kv[0]))


@graph_pass(requires=("meta:rb_kind", "ctx:units"), ensures=("ctx:regions", "meta:" + REGION))
def form_regions(gm: GraphModule, ctx: PassContext) -> PassReport:
    full_order = _reorder(gm)
    position = {n: i for i, n in enumerate(full_order)}
    order = [n for n in full_order if n.op == "call_function"]
    runs: list[list[Node]] = []
    for node in order:
        if runs and _region_key(runs[-1][-1]) == _region_key(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    units = {u.name: u for u in ctx.units}
    seen_units: set[str] = set()
    total_flops = sum(n.meta[FLOPS] for n in order) or 1
    regions = []
    for region_id, nodes in enumerate(runs):
        kind = nodes[0].meta[KIND]
        reads, exports = _io(nodes, position)
        region = {"id": region_id, "kind": kind,
                  "inputs": [n.name for n in reads], "outputs": [n.name for n in exports],
                  "flops": sum(n.meta[FLOPS] for n in nodes), "nodes": len(nodes)}
        if kind == "prunable":
            unit = units[nodes[0].meta[UNIT]]
            if unit.name in seen_units:
                raise CompileError(f"prunable unit {unit.name} is not contiguous in the graph")
            seen_units.add(unit.name)
            if exports != [unit.stream_out] or unit.stream_in not in reads:
                raise CompileError(f"unit {unit.name} breaks the residual contract: exports "
                                   f"{[n.name for n in exports]}, skip value {unit.stream_in.name}")
            region.update(name=unit.name, unit_kind=unit.kind, layer=unit.layer,
                          module_path=unit.module_path,
                          skip={unit.stream_out.name: unit.stream_in.name}, width=unit.width)
        elif kind == "cache":
            bad = [n.name for n in reads
                   if not (is_scalar(n) or (n.op == "placeholder" and n.target == "attention_mask"))]
            if bad:
                raise CompileError(f"cache region reads non-key values {bad}")
            region.update(name="shape_cache", module_path=_skeleton_name(nodes))
        else:
            region.update(name=_skeleton_name(nodes), module_path=_skeleton_name(nodes))
        region["flops_share"] = region["flops"] / total_flops
        for node in nodes:
            node.meta[REGION] = region_id
        regions.append(region)
    prunable = [r for r in regions if r["kind"] == "prunable"]
    prunable_flops = sum(r["flops"] for r in prunable) or 1
    for gate, region in enumerate(prunable):
        region["gate"] = gate
        region["prunable_share"] = region["flops"] / prunable_flops
    ctx.regions = regions
    counts = Counter(r["kind"] for r in regions)
    share = sum(r["flops"] for r in prunable) / total_flops
    return PassReport(True, f"{len(regions)} regions ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
                      f"prunable regions hold {share:.1%} of FLOPs",
                      {"regions": len(regions), **counts, "prunable_flops_share": share})
