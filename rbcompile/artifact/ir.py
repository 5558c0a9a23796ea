"""The serialisable description of a compiled graph (stored as graph.json in an artifact).

It holds only data: node names, op names, constants and regions. Codegen turns it into Python,
and `check_ir` validates every name and op against an allow-list first, so a tampered artifact
cannot make the generated code call anything but PyTorch operators.
"""
from __future__ import annotations

import importlib
import keyword
import math
import operator
import re

import torch
from torch.fx import GraphModule, Node

from rbcompile.errors import CompileError, UserError

IR_VERSION = 1
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARAM_KEY = re.compile(r"[A-Za-z0-9_.]+")
_TEXT = re.compile(r"[A-Za-z0-9_.,:+<>()/ -]*")  # strings codegen writes into comments
_OP = re.compile(r"(aten|prims|rbcompile)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")
ATTENTION = "aten.scaled_dot_product_attention.default"
# what generated code calls for an attention over grouped K/V heads (rbcompile/artifact/attention.py)
GROUPED_ATTENTION = "grouped_attention"
RESERVED_NAMES = {"self", "gates", "torch", "aten", "prims", "operator", "math", "RegionCache",
                  "Region", "Unpadded", "run_regions", "rbcompile", "rbcompile_ops",
                  GROUPED_ATTENTION}
OPERATOR_FUNCTIONS = {f"operator.{name}": getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "is_")}
# symbolic-size arithmetic that graphs from torch.compile with dynamic shapes contain
OPERATOR_FUNCTIONS.update({f"torch.{name}": getattr(torch, name) for name in (
    "sym_sum", "sym_max", "sym_min", "sym_not", "sym_float", "sym_int", "sym_ite")})
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                  "preserve_format": torch.preserve_format,
                  "channels_last": torch.channels_last}


def reads_grouped_heads(op: str, kwargs: dict) -> bool:
    """Whether an IR node is attention over grouped K/V heads (SDPA with `enable_gqa=True`)."""
    return op == ATTENTION and kwargs.get("enable_gqa") is True


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        namespace, rest = target.name().split("::")
        op, _, overload = rest.partition(".")
        return f"{namespace}.{op}.{overload or 'default'}"
    for name, fn in OPERATOR_FUNCTIONS.items():
        if target is fn:
            return name
    raise CompileError(f"unsupported operation in graph: {target}")


def resolve_op(name: str):
    if name in OPERATOR_FUNCTIONS:
        return OPERATOR_FUNCTIONS[name]
    match = _OP.fullmatch(name)
    if not match:
        raise UserError(f"corrupt artifact graph: bad operation name {name!r}")
    if match[1] == "rbcompile":  # our fused kernels: importing them registers them
        importlib.import_module("rbcompile.kernels")
    try:
        op = getattr(getattr(getattr(torch.ops, match[1]), match[2]), match[3])
    except AttributeError:
        raise UserError(f"corrupt artifact graph: unknown operation {name!r}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise UserError(f"corrupt artifact graph: {name!r} is not an operator")
    return op


def encode(value, params: dict[str, str]):
    """fx argument -> JSON value."""
    if isinstance(value, Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):
        return [encode(v, params) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, params) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    raise CompileError(f"unsupported constant in graph: {value!r} ({type(value).__name__})")


def references(value) -> list[str]:
    """Names of the nodes an encoded argument refers to, in order."""
    if isinstance(value, dict):
        (key, inner), = value.items()
        return [inner] if key == "node" else references(inner) if key == "tuple" else []
    if isinstance(value, list):
        return [name for item in value for name in references(item)]
    return []


def rename_references(value, renamed: dict[str, str]):
    """An encoded argument with the node references in `renamed` replaced."""
    if isinstance(value, dict):
        (key, inner), = value.items()
        if key == "node":
            return {"node": renamed.get(inner, inner)}
        return {key: rename_references(inner, renamed)} if key == "tuple" else value
    if isinstance(value, list):
        return [rename_references(item, renamed) for item in value]
    return value


def build_ir(gm: GraphModule, regions: list[dict], input_names, output_names,
             concatenated: dict[str, list[str]] | None = None,
             unpadded: dict | None = None) -> dict:
    """The graph after the passes, as data. `concatenated`: the weights the graph reads
    stacked (passes/fuse_projections.py: stack key -> part keys); the parts stay parameters
    (what an artifact stores, and narrower variants read) even where the graph reads only the
    stack. `unpadded`: the masks a call without padding drops (passes/unpadded_attention.py)."""
    params = {n.name: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    names = {n.name for n in gm.graph.nodes}
    for part in (part for parts in (concatenated or {}).values() for part in parts):
        if part not in params.values():
            name = part.replace(".", "_")
            while name in names or name in params:
                name += "_part"
            params[name] = part
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_function":
            nodes.append([node.name, op_name(node.target), encode(list(node.args), params),
                          {k: encode(v, params) for k, v in node.kwargs.items()},
                          node.meta["rb_region"]])
        elif node.op not in ("placeholder", "get_attr", "output"):
            raise CompileError(f"unsupported graph node {node.op} {node.target}")
    (output_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = output_node.args[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if len(outputs) != len(output_names):
        raise CompileError(f"graph has {len(outputs)} outputs for names {output_names}")
    ir = {"version": IR_VERSION, "inputs": list(input_names),
          "outputs": [[name, node.name] for name, node in zip(output_names, outputs)],
          "sequence_outputs": _sequence_outputs(gm, output_names, outputs),
          "parameters": params, "nodes": nodes, "regions": regions}
    if concatenated:
        ir["concatenated"] = dict(concatenated)
    if unpadded:
        ir["unpadded"] = dict(unpadded)
    if any(reads_grouped_heads(op, kwargs) for _, op, _, kwargs, _ in nodes):
        ir["grouped_attention"] = True   # codegen: through rbcompile/artifact/attention.py, per call
    return ir


def _sequence_outputs(gm: GraphModule, output_names, outputs) -> list[str]:
    """The outputs whose axis 1 is the first 2-D input's (the sequence: `last_hidden_state`, a
    causal LM's `logits`), not a pooled output's (`pooler_output`, a classifier's `logits`)."""
    def shape(node):
        value = node.meta.get("val") if isinstance(node, Node) else None
        return tuple(value.shape) if isinstance(value, torch.Tensor) else ()

    sequence = next((shape(n)[1] for n in gm.graph.nodes
                     if n.op == "placeholder" and len(shape(n)) == 2), None)
    return [name for name, node in zip(output_names, outputs)
            if sequence is not None and len(shape(node)) >= 2 and str(shape(node)[1]) == str(sequence)]


def _check_name(name) -> str:
    if (not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or keyword.iskeyword(name)
            or name in RESERVED_NAMES or name.startswith("__")):
        raise UserError(f"corrupt artifact graph: bad name {name!r}")
    return name


def _check_value(value, defined: set[str]) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_value(item, defined)
        return
    if isinstance(value, dict) and len(value) == 1:
        (key, inner), = value.items()
        if key == "tuple" and isinstance(inner, list):
            for item in inner:
                _check_value(item, defined)
            return
        if ((key == "node" and inner in defined)
                or (key == "float" and inner in ("inf", "-inf", "nan"))
                or (key == "dtype" and inner in DTYPES)
                or (key == "device" and isinstance(inner, str) and _IDENTIFIER.fullmatch(inner))
                or (key == "layout" and inner in LAYOUTS)
                or (key == "memory_format" and inner in MEMORY_FORMATS)):
            return
    raise UserError(f"corrupt artifact graph: bad argument {value!r}")


def _check_text(value) -> None:
    if not isinstance(value, str) or not _TEXT.fullmatch(value):
        raise UserError(f"corrupt artifact graph: bad text {value!r}")


_LABEL = re.compile(r"w[0-9]{1,3}")


def _check_variant(variant: dict, ir: dict) -> set[str]:
    """Validate one width variant; returns the view names it adds."""
    if not _LABEL.fullmatch(str(variant["label"])) or not 0 < variant["ratio"] < 1:
        raise UserError(f"corrupt artifact graph: bad width variant {variant.get('label')!r}")
    views = set()
    for name, view in variant["parameters"].items():
        if (not isinstance(view["key"], str) or not _PARAM_KEY.fullmatch(view["key"])
                or not isinstance(view["axis"], int) or not isinstance(view["length"], int)
                or view["length"] < 1):
            raise UserError(f"corrupt artifact graph: bad parameter view {name!r}")
        views.add(_check_name(name))
    prunable = {str(r["id"]) for r in ir["regions"] if r["kind"] == "prunable"}
    base = set(ir["parameters"]) | views
    defined_in = {}
    for region_id, spec in variant["regions"].items():
        if region_id not in prunable or not isinstance(spec["prunable_share"], (int, float)):
            raise UserError(f"corrupt artifact graph: bad variant region {region_id!r}")
        defined_in[region_id] = base | {_check_name(n) for n in spec["inputs"]}
    for name, op, args, kwargs, region in variant["nodes"]:
        defined = defined_in.get(str(region))
        if defined is None:
            raise UserError(f"corrupt artifact graph: variant node in region {region!r}")
        resolve_op(op)
        _check_value(args, defined)
        for key, value in kwargs.items():
            _check_name(key)
            _check_value(value, defined)
        defined.add(_check_name(name))
    for region_id, spec in variant["regions"].items():
        if not set(spec["outputs"]) <= defined_in[region_id]:
            raise UserError(f"corrupt artifact graph: variant region {region_id} output unknown")
    return views


ADD_NORMS = {"rbcompile.rms_norm.default": "rbcompile.add_rms_norm.default",
             "rbcompile.layer_norm.default": "rbcompile.add_layer_norm.default"}


def _check_seams(ir: dict) -> None:
    """Each region's `seam` (passes/mark_seams.py) names its own residual add `residual +
    branch`, one of its outputs, and the norm of the next region that reads the sum first; no
    other region and no graph output reads the sum."""
    seams = [(region, region["seam"]) for region in ir["regions"] if "seam" in region]
    if not seams:
        return
    nodes = {node[0]: node for node in ir["nodes"]}
    readers_of = {seam["add"]: [] for _, seam in seams}
    for node in ir["nodes"]:
        for name in set(references([node[2], list(node[3].values())])) & readers_of.keys():
            readers_of[name].append(node)
    for region, seam in seams:
        add, norm = nodes.get(seam["add"]), nodes.get(seam["norm"])
        readers = readers_of[seam["add"]]
        if (add is None or norm is None
                or add[1:] != ["aten.add.Tensor", [{"node": seam["residual"]},
                                                   {"node": seam["branch"]}], {}, region["id"]]
                or seam["add"] not in region["outputs"]
                or seam["add"] in (name for _, name in ir["outputs"])
                or norm[1] not in ADD_NORMS or norm[2][0] != {"node": seam["add"]}
                or not readers or readers[0] is not norm
                or any(node[4] != region["id"] + 1 for node in readers)):
            raise UserError(f"corrupt artifact graph: bad seam in region {region['id']}")


def _check_concatenated(ir: dict) -> None:
    """Each stacked weight (passes/fuse_projections.py) is a parameter of the graph, made of
    two or more other weights."""
    keys = set(ir["parameters"].values())
    for key, parts in ir.get("concatenated", {}).items():
        if (key not in keys or not isinstance(parts, list) or len(parts) < 2
                or not all(isinstance(p, str) and _PARAM_KEY.fullmatch(p) and p != key
                           for p in parts)):
            raise UserError(f"corrupt artifact graph: bad stacked weight {key!r}")


def _check_unpadded(ir: dict) -> None:
    """The masks a call without padding drops (passes/unpadded_attention.py) are outputs of
    regions, read after their region only as attention masks (in width variants too), by
    causal attentions with `is_causal=operator.is_(mask, None)`; the mask input, the inputs
    whose sizes it is filled with and the start input are graph inputs."""
    spec = ir.get("unpadded")
    if spec is None:
        return
    made = {name for region in ir["regions"] for name in region["outputs"]}
    others = set(ir["inputs"]) - {spec["input"]}
    if (spec["input"] not in ir["inputs"] or not isinstance(spec["causal"], bool)
            or not isinstance(spec["like"], list) or not spec["like"]
            or not all(isinstance(size, list) and len(size) == 2 and size[0] in others
                       and type(size[1]) is int and size[1] >= 0 for size in spec["like"])
            or spec["start"] not in (None, *others)
            or not isinstance(spec["masks"], list) or not spec["masks"]
            or not set(spec["masks"]) <= made):
        raise UserError("corrupt artifact graph: bad unpadded attention masks")
    masks, causal = set(spec["masks"]), spec["causal"]
    made_in = {node[0]: node[4] for node in ir["nodes"] if node[0] in masks}
    for nodes in (ir["nodes"], *(variant["nodes"] for variant in ir.get("variants", []))):
        tests = {}  # operator.is_(mask, None) nodes -> the mask
        for name, op, args, kwargs, region in nodes:
            reads = {mask for mask in references([args, list(kwargs.values())])
                     if mask in masks and made_in[mask] != region}  # its own region: the mask
            if not reads:
                continue
            if op == "operator.is_" and len(args) == 2 and args[1] is None:
                tests[name] = args[0]["node"]
                continue
            mask = args[3]["node"] if op == ATTENTION and len(args) > 3 else None
            flag = kwargs.get("is_causal")
            tested = tests.get(flag["node"]) if isinstance(flag, dict) else None
            if reads != {mask} or (tested != mask if causal else flag is not None):
                raise UserError(f"corrupt artifact graph: {name} reads a dropped attention mask")


def check_ir(ir: dict) -> None:
    """Validate an IR loaded from disk before generating code from it."""
    try:
        if ir.get("version") != IR_VERSION:
            raise UserError(f"artifact graph version {ir.get('version')!r} is not {IR_VERSION}")
        defined = {_check_name(n) for n in ir["inputs"]}
        for name, key in ir["parameters"].items():
            if not isinstance(key, str) or not _PARAM_KEY.fullmatch(key):
                raise UserError(f"corrupt artifact graph: bad parameter key {key!r}")
            defined.add(_check_name(name))
        n_regions = len(ir["regions"])
        for name, op, args, kwargs, region in ir["nodes"]:
            resolve_op(op)
            _check_value(args, defined)
            for key, value in kwargs.items():
                _check_name(key)
                _check_value(value, defined)
            if not isinstance(region, int) or not 0 <= region < n_regions:
                raise UserError(f"corrupt artifact graph: bad region {region!r}")
            defined.add(_check_name(name))
        _check_text(ir["title"])
        for index, region in enumerate(ir["regions"]):
            if region["id"] != index or region["kind"] not in ("skeleton", "prunable", "cache"):
                raise UserError(f"corrupt artifact graph: bad region {index}")
            for key in ("name", "module_path", "unit_kind"):
                _check_text(region.get(key, ""))
            for key in ("flops_share", "prunable_share", "gate", "layer"):
                if not isinstance(region.get(key, 0), (int, float)):
                    raise UserError(f"corrupt artifact graph: bad {key} in region {index}")
            for name in [*region["inputs"], *region["outputs"], *region.get("skip", {}).values()]:
                if name not in defined:
                    raise UserError(f"corrupt artifact graph: region reads unknown {name!r}")
        for _, name in ir["outputs"]:
            if name not in defined:
                raise UserError(f"corrupt artifact graph: unknown output {name!r}")
        if not set(ir.get("sequence_outputs", [])) <= {name for name, _ in ir["outputs"]}:
            raise UserError("corrupt artifact graph: unknown sequence output")
        _check_seams(ir)
        _check_concatenated(ir)
        _check_unpadded(ir)
        if ir.get("grouped_attention", True) is not True:
            raise UserError("corrupt artifact graph: bad grouped_attention")
        params = set(ir["parameters"])
        for variant in ir.get("variants", []):
            params |= _check_variant(variant, ir)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"corrupt artifact graph: {type(exc).__name__}: {exc}") from None
