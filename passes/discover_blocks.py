"""Find the repeated transformer blocks and, inside each, the residual branches.

Requires: `rb_deps`. Ensures `ctx:blocks` and `meta:rb_block` (block index or None).

Blocks come from module paths: the numbered child modules of one list (`model.layers.<i>`,
`transformer.h.<i>`, `encoder.layer.<i>`) that cover the most nodes. A block must read exactly one
data-dependent value from outside (the residual stream in) and export exactly one (stream out).
Branches come from dataflow: a pre-LN block has two adds at block level, `a1 = x + f(x)` and
`out = a1 + g(a1)`; each branch is the add plus the block nodes it depends on. A post-LN block
(BERT) has no such adds and is kept whole.

Graphs captured with a KV cache also read the past K/V as graph inputs and either return the new
K/V as graph outputs (torch.compile of a decoder called with `use_cache=True`) or write them
into the cache inputs in place (`index_copy_`: an artifact's decoder, trace.CachedDecoder):
besides the stream, a block (and a branch) may read inputs and export values that only the
graph output reads, or write inputs; those are its `cache_outputs`.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict

import torch
from torch.fx import GraphModule, Node

from rbcompile.errors import CompileError
from rbcompile.passes.base import (
    BLOCK,
    DEPS,
    FLOPS,
    Block,
    Branch,
    PassContext,
    PassReport,
    compute_nodes,
    graph_pass,
    is_add,
    is_scalar,
    module_path,
    module_stack,
    writes_input,
)

_NUMBERED = re.compile(r"(.+)\.(\d+)")


def _block_list(nodes: list[Node]) -> tuple[str, str, list[int]]:
    """(list path, block type, indices) of the numbered module list covering the most nodes."""
    coverage: Counter[tuple[str, str]] = Counter()
    indices: dict[tuple[str, str], set[int]] = defaultdict(set)
    for node in nodes:
        seen = set()
        for path, type_name in module_stack(node):
            match = _NUMBERED.fullmatch(path)
            if match and (match[1], type_name) not in seen:
                key = (match[1], type_name)
                seen.add(key)
                coverage[key] += 1
                indices[key].add(int(match[2]))
    for key, _ in coverage.most_common():  # a graph-break fragment may start past layer 0
        first = min(indices[key])
        if indices[key] == set(range(first, first + len(indices[key]))):
            return key[0], key[1], sorted(indices[key])
    raise CompileError("no repeated transformer blocks found in the traced graph")


def _external(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """(values read from outside, values used outside) of a node set, in graph order. A write
    into a graph input (an in-place K/V cache update) counts as used outside."""
    members = set(nodes)
    reads, exports = {}, {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in members:
                reads[inp] = None
        if writes_input(node) or any(user not in members for user in node.users):
            exports[node] = None
    return list(reads), list(exports)


def _same_shape(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and [str(d) for d in va.shape] == [str(d) for d in vb.shape])


def _output_only(node: Node, members: set[Node]) -> bool:
    """True when, outside `members`, only the graph output reads `node`, or it writes a graph
    input in place: a K/V cache value."""
    return writes_input(node) or all(user.op == "output" for user in node.users
                                     if user not in members)


def _ancestors_within(root: Node, members: set[Node]) -> set[Node]:
    found, stack = {root}, [root]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp in members and inp not in found:
                found.add(inp)
                stack.append(inp)
    return found


def _branch_name_and_kind(nodes: list[Node], block_path: str) -> tuple[str, str, str]:
    flops: Counter[str] = Counter()
    attention = False
    for node in nodes:
        path = module_path(node)
        if path.startswith(block_path + "."):
            child = path[len(block_path) + 1:].split(".")[0]
            flops[child] += node.meta[FLOPS] + 1
        if "scaled_dot_product_attention" in str(node.target) or "softmax" in str(node.target):
            attention = True
        if any("Attention" in type_name for _, type_name in module_stack(node)):
            attention = True
    name = flops.most_common(1)[0][0] if flops else "branch"
    return name, f"{block_path}.{name}", "attention" if attention else "mlp"


def _split_branches(block: Block) -> list[Branch]:
    """Residual branches of a pre-LN block, or [] when the block is not of that shape."""
    adds = [n for n in block.nodes if is_add(n) and module_path(n) == block.module_path]
    if len(adds) != 2:
        return []
    first, second = adds
    if block.stream_in not in first.args or first not in second.args or second is not block.stream_out:
        return []
    members = set(block.nodes)
    first_nodes = _ancestors_within(first, members)
    second_nodes = members - first_nodes
    neither = members - _ancestors_within(second, members)
    if neither:  # only cache bookkeeping (a length counter) may feed neither residual add
        bookkeeping = set().union(*(_ancestors_within(n, members) for n in block.cache_outputs))
        if not neither <= bookkeeping:
            return []  # not a clean pre-LN block
        first_nodes |= neither  # with the branch that writes the cache
        second_nodes -= neither
    ordered = {n: i for i, n in enumerate(block.nodes)}
    branches = []
    for nodes, stream_in, stream_out in ((first_nodes, block.stream_in, first),
                                         (second_nodes, first, second)):
        nodes = sorted(nodes, key=ordered.__getitem__)
        reads, exports = _external(nodes)
        cache_outputs = [n for n in exports if n is not stream_out]
        if (stream_out not in exports or stream_in not in reads
                or not set(cache_outputs) <= set(block.cache_outputs)):
            return []
        name, path, kind = _branch_name_and_kind(nodes, block.module_path)
        branches.append(Branch(name, kind, path, nodes, stream_in, stream_out, cache_outputs))
    return branches


@graph_pass(requires=("meta:rb_deps",), ensures=("ctx:blocks", "meta:" + BLOCK))
def discover_blocks(gm: GraphModule, ctx: PassContext) -> PassReport:
    nodes = compute_nodes(gm)
    list_path, block_type, indices = _block_list(nodes)
    by_block: dict[int, list[Node]] = defaultdict(list)
    for node in nodes:
        node.meta[BLOCK] = None
        for path, _ in module_stack(node):
            match = _NUMBERED.fullmatch(path)
            if match and match[1] == list_path:
                by_block[int(match[2])].append(node)
                break
    blocks = []
    for index in indices:
        members = set(by_block[index])
        # shape arithmetic stays in the block only if nothing outside needs it
        nodes_i = [n for n in by_block[index]
                   if not is_scalar(n) or all(u in members for u in n.users)]
        reads, exports = _external(nodes_i)
        data_reads = [n for n in reads if n.op != "get_attr" and "data" in n.meta[DEPS]]
        cache_outputs = [] if len(exports) == 1 else [n for n in exports if _output_only(n, members)]
        streams_out = [n for n in exports if n not in cache_outputs]
        streams_in = [n for n in data_reads if n.op != "placeholder"] or data_reads  # not past K/V
        if len(streams_in) > 1 and len(streams_out) == 1:  # graph inputs of a fragment: by shape
            streams_in = [n for n in streams_in if _same_shape(n, streams_out[0])]
        path = f"{list_path}.{index}"
        if len(streams_in) != 1 or len(streams_out) != 1:
            raise CompileError(
                f"block {path} does not read and write one residual stream "
                f"(reads {[n.name for n in streams_in]}, exports {[n.name for n in streams_out]})")
        block = Block(index, path, block_type, nodes_i, streams_in[0], streams_out[0], [],
                      cache_outputs)
        block.branches = _split_branches(block)
        for node in nodes_i:
            node.meta[BLOCK] = index
        blocks.append(block)
    ctx.blocks = blocks
    split = sum(1 for b in blocks if b.branches)
    kinds = "/".join(br.name for br in blocks[0].branches) if blocks[0].branches else "whole"
    span = f"{list_path}.<i>" if indices[0] == 0 else f"{list_path}.{indices[0]}-{indices[-1]}"
    return PassReport(True, f"{len(indices)} x {block_type} at {span}; {split} split into "
                      f"residual branches ({kinds})",
                      {"blocks": len(indices), "block_type": block_type, "split_blocks": split})
