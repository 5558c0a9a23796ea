"""The pass interface: every pass is a function `(gm, ctx) -> PassReport`.

Like torch.fx's PassBase, a pass states what it *requires* (facts established by earlier passes)
and what it *ensures*. A fact is either `meta:<key>` (every call_function node carries
`node.meta[key]`) or `ctx:<attribute>` (the context attribute is set). The pipeline checks both.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from rbcompile.artifact.architectures import Architecture, Dimensions

# node.meta keys written by the passes
DEPS = "rb_deps"          # frozenset of {"data", "mask", "shape"}: what the value depends on
FLOPS = "rb_flops"        # matmul-class FLOPs at the reference shape
SHAPE = "rb_shape"        # concrete output shape at the reference shape (tensors only)
BLOCK = "rb_block"        # index of the transformer block the node belongs to, or None
KIND = "rb_kind"          # "skeleton" | "prunable" | "cache"
UNIT = "rb_unit"          # prunable unit name, e.g. "layers.3.self_attn" (prunable nodes only)
REGION = "rb_region"      # region id after partitioning


@dataclass
class PassReport:
    """What a pass did: `changed` says whether the graph or its marks changed. (Not torch.fx's
    PassResult: passes here change `gm` in place and report, they do not return a new one.)"""
    changed: bool
    summary: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Branch:
    """A residual branch inside a pre-LN block: stream_out = stream_in + f(stream_in)."""
    name: str                # child module name, e.g. "self_attn" or "mlp"
    kind: str                # "attention" | "mlp"
    module_path: str
    nodes: list[Node]
    stream_in: Node
    stream_out: Node         # the residual add
    cache_outputs: list[Node] = field(default_factory=list)  # K/V written to the graph outputs


@dataclass
class Block:
    """One repeated transformer block (a layer)."""
    index: int
    module_path: str
    module_type: str
    nodes: list[Node]
    stream_in: Node
    stream_out: Node
    branches: list[Branch]   # empty when the block is not split into residual branches (post-LN)
    cache_outputs: list[Node] = field(default_factory=list)  # values only the graph output reads


@dataclass
class Unit:
    """A prunable unit: a whole layer or one residual branch; skipping it is an identity."""
    name: str
    kind: str                # "layer" | "attention" | "mlp"
    layer: int
    module_path: str
    nodes: list[Node]
    stream_in: Node
    stream_out: Node
    width: dict[str, Any]    # width units inside: heads / channels and the parameters they live in


@dataclass
class PassContext:
    """State shared by the passes of one compilation."""
    family: str                              # "decoder" | "encoder"
    reference_inputs: dict[str, torch.Tensor]
    input_names: tuple[str, ...]
    architecture: Architecture | None = None  # None: a torch.compile graph (no config)
    dims: Dimensions | None = None           # the model's sizes (with `architecture`)
    blocks: list[Block] | None = None
    units: list[Unit] | None = None
    cache_candidates: dict[str, Any] | None = None
    regions: list[dict[str, Any]] | None = None
    width_importance: dict[str, dict[str, list[float]]] | None = None  # unit -> heads / channels
    permutations: dict[str, dict[str, list[int]]] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    kernels: bool = False                    # fuse_kernels: replace patterns with fused kernels
    fuse_projections: bool = False           # fuse_projections: stack projections of one input
    concatenated: dict[str, list[str]] = field(default_factory=dict)  # stacked key -> part keys
    unpadded: dict[str, Any] | None = None   # unpadded_attention: masks dropped without padding
    dump_pass: str | None = None             # dump the graph before/after this pass
    dump_dir: str | None = None


PassFn = Callable[[GraphModule, PassContext], PassReport]


def graph_pass(*, requires: tuple[str, ...] = (), ensures: tuple[str, ...] = ()):
    """Declare a pass's contract; the pipeline checks it before and after the pass runs."""
    def wrap(fn: PassFn) -> PassFn:
        fn.requires = requires
        fn.ensures = ensures
        fn.pass_name = fn.__module__.rsplit(".", 1)[-1]
        return fn
    return wrap


# ---- node helpers shared by the passes --------------------------------------------------------

# dynamo names a module by how the compiled code reached it: `L['args'][0].model.layers.0` (the
# compiled module), `L['local']...` (a closure), `G['model']...` (a global). The outermost entry
# names the model; an entry under another root is a module outside its tree: transformers 5.25
# makes `apply_rotary_pos_emb` a module-level module, `G['__import_...'].apply_rotary_pos_emb`.
_DYNAMO_ROOT = re.compile(r"[LG]\['[^']*'\](?:\[(?:\d+|'[^']*')\])*\.")


def module_stack(node: Node) -> list[tuple[str, str]]:
    """[(module path, module type name)] from outermost to innermost, relative to the model (the
    outermost entry's root). Modules outside the model's tree are left out: their nodes belong
    to the module that called them."""
    stack = node.meta.get("nn_module_stack") or {}
    out, model_root = [], None
    for path, type_ in stack.values():
        root = _DYNAMO_ROOT.match(path)
        if root:
            model_root = model_root or root.group(0)
            if root.group(0) != model_root:
                continue
            path = path[len(model_root):]
        type_name = type_ if isinstance(type_, str) else getattr(type_, "__qualname__", str(type_))
        out.append((path, type_name.rsplit(".", 1)[-1]))
    return out


def module_path(node: Node) -> str:
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def is_scalar(node: Node) -> bool:
    """True for nodes producing Python/symbolic scalars (shape arithmetic), not tensors."""
    val = node.meta.get("val")
    return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def writes_input(node: Node) -> bool:
    """True for an op that changes one of its inputs in place (a K/V cache write)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and bool(schema and schema.is_mutable)


def erase_unused(node: Node) -> None:
    """Erase `node` and then its inputs while nothing reads them (never a cache write)."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current.op == "call_function" and not current.users and not writes_input(current):
            inputs = list(current.all_input_nodes)
            current.graph.erase_node(current)
            pending += inputs


def structure(value, through: Callable[[Node], bool]):
    """A hashable stand-in for `value` (an argument): the nodes `through` accepts by their op
    and inputs, recursively, so two of them computing alike from the same inputs are equal;
    other nodes themselves."""
    if isinstance(value, Node):
        if value.op == "call_function" and through(value):
            return (value.target, structure(value.args, through), structure(value.kwargs, through))
        return value
    if isinstance(value, (list, tuple)):
        return tuple(structure(v, through) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, structure(v, through)) for k, v in value.items()))
    return value


def is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def tensor_val(value) -> torch.Tensor | None:
    """The (fake) tensor a node computes, or None (a non-node argument, a scalar, no meta)."""
    val = value.meta.get("val") if isinstance(value, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def compute_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def is_add(node: Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.aten.add.Tensor, operator.add,
                                                          torch.add)


def check_facts(gm: GraphModule, ctx: PassContext, facts: tuple[str, ...], what: str) -> None:
    for fact in facts:
        kind, _, key = fact.partition(":")
        if kind == "meta":
            missing = [n.name for n in compute_nodes(gm) if key not in n.meta]
            if missing:
                raise AssertionError(f"{what}: node.meta[{key!r}] missing on {missing[:5]}")
        elif kind == "ctx":
            if getattr(ctx, key) is None:
                raise AssertionError(f"{what}: ctx.{key} is not set")
        else:
            raise ValueError(f"bad fact {fact!r}")
