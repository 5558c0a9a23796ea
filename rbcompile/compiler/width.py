"""Elastic width: narrower variants of the prunable regions, built from the permuted weights.

After `permute_width`, the most important heads and channels come first, so a region at width r
keeps a prefix: its weights are views (`narrow`) of the full ones, never copies. Each width level
is traced from a narrowed copy of the model (attention keeps whole key/value groups with their
query heads; MLPs keep the first channels), run through the same structural passes, and its
prunable regions become extra methods the generated forward picks by `widths[gate]`.
The safety floor is the lowest level: no plan keeps fewer than `floor` of a layer's heads.
GPT-2 fuses q/k/v in one matrix (a prefix is not a view), so only its MLPs get width levels;
Phi-3 fuses q/k/v and gate/up (no width levels), OLMo 2's q/k norms span all heads (MLPs only).
"""
from __future__ import annotations

import copy
import math

import torch

from rbcompile.artifact.architectures import CHANNELS, KV_HEADS, QUERY_HEADS
from rbcompile.artifact.ir import build_ir, references, rename_references
from rbcompile.compiler.trace import trace
from rbcompile.errors import CompileError
from rbcompile.passes import PassContext, run_pipeline

DEFAULT_LEVELS = (0.75, 0.5)


def level_label(ratio: float) -> str:
    return f"w{round(ratio * 100)}"


def kept_counts(unit, ratio: float) -> dict[str, int]:
    """Rows/columns kept per index space at a width ratio (whole KV groups for GQA)."""
    counts = {}
    if "heads" in unit.width:
        kv, heads, dim = unit.width["kv_heads"], unit.width["heads"], unit.width["head_dim"]
        groups = max(1, math.ceil(ratio * kv))
        counts[QUERY_HEADS], counts[KV_HEADS] = groups * (heads // kv) * dim, groups * dim
    if "channels" in unit.width:
        counts[CHANNELS] = max(1, math.ceil(ratio * unit.width["channels"]))
    return counts


def _parameter(model, name: str):
    module_path, attr = name.rsplit(".", 1)
    try:
        return getattr(model.get_submodule(module_path), attr, None)
    except AttributeError:
        return None


def _narrow_parameter(model, name: str, axis: int, length: int) -> None:
    module_path, attr = name.rsplit(".", 1)
    module = model.get_submodule(module_path)
    tensor = getattr(module, attr)
    setattr(module, attr, torch.nn.Parameter(tensor.detach().narrow(axis, 0, length),
                                             requires_grad=False))
    if hasattr(module, "nf") and attr == "weight" and axis == 1:  # transformers Conv1D
        module.nf = length


def narrowed_model(eager, weights: dict[str, torch.Tensor], architecture, units, blocks,
                   ratio: float):
    """A copy of the model holding the (permuted) weights, each unit narrowed to `ratio`;
    returns (model, {parameter key: (axis, length)})."""
    model = copy.deepcopy(eager)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name])
    views = {}
    for unit in units:
        counts = kept_counts(unit, ratio)
        block_path = blocks[unit.layer].module_path
        for part in ("heads", "channels"):
            entries = architecture.width_parameters(part) if part in unit.width else ()
            if any(param.fused > 1 or param.blocks or not param.narrowable for param in entries):
                continue  # fused q/k/v: a prefix would not be a view; see WidthParameter
            for param in entries:
                name = f"{block_path}.{param.suffix}"
                tensor = _parameter(model, name)
                length = counts[param.space]
                if tensor is not None and length < tensor.shape[param.axis]:
                    _narrow_parameter(model, name, param.axis, length)
                    views[name] = (param.axis, length)
    return model.eval(), views


def build_variant(eager, ir: dict, weights: dict[str, torch.Tensor], ctx,
                  ratio: float) -> dict | None:
    """Trace the model at width `ratio` and return the IR of its narrowed prunable regions
    (`ir`: the full graph's; `weights`: the tensors the artifact stores, by key)."""
    model, views = narrowed_model(eager, weights, ctx.architecture, ctx.units, ctx.blocks, ratio)
    if not views:
        return None
    traced = trace(model, ctx.architecture)
    vctx = PassContext(family=ctx.family, input_names=traced.input_names,
                       reference_inputs=ctx.reference_inputs, architecture=ctx.architecture,
                       dims=ctx.dims, kernels=ctx.kernels)
    run_pipeline(traced.graph_module, vctx)
    vir = build_ir(traced.graph_module, vctx.regions, traced.input_names, traced.output_names)
    full_by_name = {r["name"]: r for r in ir["regions"] if r["kind"] == "prunable"}
    label = level_label(ratio)
    full_params = ir["parameters"]
    full_names = {key: name for name, key in full_params.items()}
    regions, region_map, parameters, renamed = {}, {}, {}, {}
    prunable_flops = sum(r["flops"] for r in ir["regions"] if r["kind"] == "prunable")
    for region in vctx.regions:
        if region["kind"] != "prunable":
            continue
        full = full_by_name.get(region["name"])
        if full is None or len(full["inputs"]) != len(region["inputs"]):
            raise CompileError(f"width {ratio}: region {region['name']} does not match the full "
                               "graph's region")
        region_map[region["id"]] = full["id"]
        regions[str(full["id"])] = {"inputs": region["inputs"], "outputs": region["outputs"],
                                    "prunable_share": region["flops"] / prunable_flops}
    for name, key in vir["parameters"].items():
        if key in views:
            axis, length = views[key]
            renamed[name] = f"{full_names[key]}_{label}"
            parameters[renamed[name]] = {"key": key, "axis": axis, "length": length}
        elif key in full_names:
            renamed[name] = full_names[key]
    nodes = []
    for name, op, args, kwargs, region_id in vir["nodes"]:
        if region_id in region_map:
            nodes.append([name, op, rename_references(args, renamed),
                          {k: rename_references(v, renamed) for k, v in kwargs.items()},
                          region_map[region_id]])
    narrowed = {str(n[4]) for n in nodes if set(references(n[2])) & set(parameters)}
    regions = {k: v for k, v in regions.items() if k in narrowed}  # e.g. not GPT-2 attention
    nodes = [n for n in nodes if str(n[4]) in narrowed]
    return {"ratio": ratio, "label": label, "parameters": parameters, "regions": regions,
            "nodes": nodes}
