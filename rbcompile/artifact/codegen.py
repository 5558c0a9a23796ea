"""Generate the runtime module's Python source from the IR (see ir.py).

The generated class has one method per region (and per width level of a prunable region), the
table of its regions `REGIONS` (rbcompile/artifact/regions.py: method names are decided here, once) and a
`forward` that runs that table through the region interpreter: skeleton regions always,
cache-reuse regions from a shape-keyed cache, each prunable region only when its gate is on
(otherwise its output is the residual stream it reads: an identity).

With `guards="cond"` (ONNX export only, never saved) each gate is a `torch.cond` on a bool
tensor `gates[i]`, which exports as an ONNX `If`; cache regions are computed directly and the
width levels are chosen in Python, so a given `widths` list is baked in; fused kernels
(`rbcompile.*` ops) call their PyTorch references, which export as plain ONNX, and attention
takes torch's semantics for rows without a key (onnx_export.EXPORT_ATEN).
"""
from __future__ import annotations

from rbcompile.artifact.ir import (
    ADD_NORMS,
    GROUPED_ATTENTION,
    check_ir,
    reads_grouped_heads,
    references,
)

_INDENT = " " * 4


def _arg(value, params: dict[str, str]) -> str:
    if isinstance(value, dict):
        (key, inner), = value.items()
        if key == "node":
            return f"self.{inner}" if inner in params else inner
        if key == "tuple":
            items = [_arg(v, params) for v in inner]
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        if key == "float":
            return f"float({inner!r})"
        if key == "dtype":
            return f"torch.{inner}"
        if key == "device":
            return "self.device"
        return f"torch.{inner}"  # layout, memory_format
    if isinstance(value, list):
        return "[" + ", ".join(_arg(v, params) for v in value) + "]"
    return repr(value)


KERNELS = "rbcompile."  # op names of the fused kernels (torch.ops.rbcompile, see kernels/)


def _call(op: str, args: list, kwargs: dict, params: dict[str, str]) -> str:
    parts = [_arg(a, params) for a in args] + [f"{k}={_arg(v, params)}" for k, v in kwargs.items()]
    if op.startswith(KERNELS):
        op = "rbcompile_ops." + op[len(KERNELS):]
    return f"{op}({', '.join(parts)})"


def _route_grouped_attention(ir: dict) -> dict:
    """`ir` with each attention over grouped K/V heads (`enable_gqa=True`) calling
    `grouped_attention`, which picks its form per call (rbcompile/artifact/attention.py). Only for an IR
    that asks for it (`grouped_attention`: older artifacts call SDPA, and their code stays)."""
    def routed(nodes):
        return [[name, GROUPED_ATTENTION, args,
                 {key: value for key, value in kwargs.items() if key != "enable_gqa"}, region]
                if reads_grouped_heads(op, kwargs)
                else [name, op, args, kwargs, region] for name, op, args, kwargs, region in nodes]

    return {**ir, "nodes": routed(ir["nodes"]),
            "variants": [{**v, "nodes": routed(v["nodes"])} for v in ir.get("variants", [])]}


def _last_reads(reads: list[list[str]], keep=frozenset()) -> list[list[str]]:
    """Per step (given the names each step reads), the names not in `keep` it reads last."""
    last = {name: index for index, names in enumerate(reads) for name in names}
    return [[name for name in dict.fromkeys(names) if last[name] == index and name not in keep]
            for index, names in enumerate(reads)]


def _with_deletes(statements: list[tuple[str, list[str]]], indent: str) -> list[str]:
    """Lines for (code, names read) statements, deleting each name after its last read."""
    lines = []
    for (code, _), dead in zip(statements, _last_reads([reads for _, reads in statements])):
        lines.append(indent + code)
        if dead and not code.startswith("return"):
            lines.append(f"{indent}del {', '.join(dead)}")
    return lines


def _method_name(region: dict, variant: dict | None = None) -> str:
    """The name of a region's method (of its narrowed twin for a width `variant`)."""
    safe = "".join(c if c.isalnum() else "_" for c in region["name"]).strip("_")
    name = f"r{region['id']}_{safe}"[:60]
    return name if variant is None else f"{name}_{variant['label']}"


def _tuple(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names)


def _method(header: str, name: str, inputs, outputs, nodes: list, params) -> list[str]:
    """A method computing `outputs` from `inputs` with `nodes` (IR nodes), deleting each value
    after its last read."""
    lines = [header, f"{_INDENT}def {name}(self, {', '.join(inputs)}):"]
    statements = []
    for node_name, op, args, kwargs, _ in nodes:
        reads = [name for name in references([args, list(kwargs.values())])
                 if name not in params]
        statements.append((f"{node_name} = {_call(op, args, kwargs, params)}", reads))
    statements.append((f"return {_tuple(outputs)}", outputs))
    return lines + _with_deletes(statements, _INDENT * 2)


def _region_method(region: dict, nodes: list, params, variant: dict | None = None) -> list[str]:
    """A region's method; for a width variant, its narrowed twin (same region id and role)."""
    if variant is None:
        header = (f"{_INDENT}# region {region['id']}: {region['kind']}"
                  f"{' (' + region['unit_kind'] + ')' if region['kind'] == 'prunable' else ''}"
                  f", {region['module_path']}, {region['flops_share']:.2%} of FLOPs")
        return _method(header, _method_name(region), region["inputs"], region["outputs"], nodes,
                       params)
    spec = variant["regions"][str(region["id"])]
    header = (f"{_INDENT}# region {region['id']} at width {variant['ratio']:g}: "
              f"{region['module_path']}, {spec['prunable_share']:.2%} of prunable FLOPs")
    return _method(header, _method_name(region, variant), spec["inputs"], spec["outputs"], nodes,
                   params)


# a seam variant of a region's method (passes/mark_seams.py): which seams it fuses -> suffix
SEAM_VARIANTS = {"in": "add_norm", "out": "unadded", "in+out": "add_norm_unadded"}


def _seams(ir: dict, region: dict) -> tuple[dict | None, dict | None]:
    """The seam `region` may close (the previous region's) and the one it may open (its own)."""
    previous = ir["regions"][region["id"] - 1] if region["id"] else {}
    return previous.get("seam"), region.get("seam")


def _seam_variants(ir: dict, region: dict) -> dict[str, str]:
    """Seam variant -> method of `region`: "in" takes the previous region's open sum as its two
    terms and adds them in its first norm, "out" leaves its own last residual add open (returns
    the two terms), "in+out" both."""
    sides = [side for side, seam in zip(("in", "out"), _seams(ir, region)) if seam]
    keys = [*sides, "+".join(sides)] if len(sides) == 2 else sides
    return {key: f"{_method_name(region)}_{SEAM_VARIANTS[key]}" for key in keys}


def _apart(names, seam: dict | None) -> list[str]:
    """`names` with the seam's sum replaced by its two terms."""
    if seam is None:
        return list(names)
    return [part for name in names
            for part in ((seam["residual"], seam["branch"]) if name == seam["add"] else (name,))]


def _add_in_norm(nodes: list, seam: dict, taken: set[str]) -> list:
    """`nodes` with the seam's norm `norm(sum, ...)` replaced by the add+norm kernel on the
    sum's two terms, which also gives back the sum (fuse_kernels' convention)."""
    pair = seam["norm"] + "_sum"
    while pair in taken:
        pair += "_"
    out = []
    for node in nodes:
        if node[0] != seam["norm"]:
            out.append(node)
            continue
        name, op, args, kwargs, region_id = node
        out += [[pair, ADD_NORMS[op], [{"node": seam["branch"]}, {"node": seam["residual"]},
                                       *args[1:]], kwargs, region_id],
                [name, "operator.getitem", [{"node": pair}, 0], {}, region_id],
                [seam["add"], "operator.getitem", [{"node": pair}, 1], {}, region_id]]
    return out


def _seam_methods(ir: dict, region: dict, nodes: list, params, taken: set[str]) -> list[str]:
    """`region`'s seam variants (see `_seam_variants`)."""
    closes, opens = _seams(ir, region)
    lines = []
    for key, name in _seam_variants(ir, region).items():
        seam_in = closes if "in" in key else None
        seam_out = opens if "out" in key else None
        body = _add_in_norm(nodes, seam_in, taken) if seam_in else nodes
        outputs = _apart(region["outputs"], seam_out)
        if seam_out:
            body = [node for node in body if node[0] != seam_out["add"]]
        if seam_in and seam_in["add"] not in outputs and not any(
                seam_in["add"] in references([n[2], list(n[3].values())]) for n in body):
            body = [node for node in body if node[0] != seam_in["add"]]  # the sum is unread
        what = " and ".join(
            [*([f"adding region {region['id'] - 1}'s open residual add in its first norm"]
               if seam_in else []),
             *(["leaving its last residual add open"] if seam_out else [])])
        lines += ["", *_method(f"{_INDENT}# region {region['id']} {what}", name,
                               _apart(region["inputs"], seam_in),
                               outputs, body, params)]
    return lines


def _levels(region: dict, variants: list[dict]) -> list[dict]:
    """The width variants (widest first) that narrow `region`."""
    return [v for v in variants if str(region["id"]) in v["regions"]]


def _table(ir: dict, variants: list[dict]) -> list[str]:
    """The class-level `REGIONS` table (rbcompile/artifact/regions.py), in run order. A region drops the
    values it reads last (never the graph's inputs or outputs), as `_with_deletes` does."""
    keep = {*ir["inputs"], *(name for _, name in ir["outputs"])}
    drops = _last_reads([region["inputs"] for region in ir["regions"]], keep)
    lines = [f"{_INDENT}REGIONS = ("]
    new_row = ",\n" + _INDENT * 2 + " " * len("Region(")
    for region, drop in zip(ir["regions"], drops):
        rows = [f"{region['id']!r}, {region['kind']!r}, {_method_name(region)!r}",
                f"inputs={tuple(region['inputs'])!r}, outputs={tuple(region['outputs'])!r}"]
        if region["kind"] == "prunable":
            (out, stream_in), = region["skip"].items()
            levels = tuple((v["ratio"], _method_name(region, v)) for v in _levels(region, variants))
            rows += [f"gate={region['gate']!r}, skip={(out, stream_in)!r}",
                     *([f"levels={levels!r}"] if levels else [])]
        seam_methods = _seam_variants(ir, region)
        if seam_methods:
            seams = tuple(seam and seam["add"] for seam in _seams(ir, region))
            rows.append(f"seams={seams!r}, seam_methods={tuple(seam_methods.items())!r}")
        rows += [f"drop={tuple(drop)!r}"] if drop else []
        lines.append(f"{_INDENT * 2}Region({new_row.join(rows)}),")
    return lines + [f"{_INDENT})"]


def _forward(ir: dict, guards: str) -> list[str]:
    """`forward`: the graph inputs by name, run through the region table (regions.py)."""
    env = ", ".join(f"{name!r}: {name}" for name in ir["inputs"])
    results = ", ".join(f"env[{name!r}]" for _, name in ir["outputs"])
    guards_arg = f", guards={guards!r}" if guards != "python" else ""
    return [f"{_INDENT}def forward(self, {', '.join(ir['inputs'])}, gates, widths=None):",
            f'{_INDENT * 2}"""Run the model; `gates[i]` turns prunable region i on (True) or off;',
            f'{_INDENT * 2}`widths[i]` (optional) narrows it to the smallest width level >= it."""',
            f"{_INDENT * 2}env = run_regions(self, {{{env}}}, gates, widths{guards_arg})",
            f"{_INDENT * 2}return ({results},)"]


def _concatenated(stacks: dict[str, list[str]]) -> list[str]:
    """The CONCATENATED table, where the graph stacks weights (older artifacts have none, and
    their code stays what it was)."""
    if not stacks:
        return []
    return ["    # weights key -> the keys it stacks by rows (attach_weights makes it; the parts are",
            "    # then its views)",
            "    CONCATENATED = {",
            *(f"        {key!r}: {parts!r}," for key, parts in stacks.items()),
            "    }"]


def _unpadded(spec: dict | None) -> list[str]:
    """The UNPADDED record (rbcompile/artifact/regions.py), where the graph has masks a call without
    padding drops (older artifacts have none, and their code stays what it was)."""
    if not spec:
        return []
    return ["    # a call whose mask input is None (no padding) drops these masks: attention without",
            "    # them (passes/unpadded_attention.py)",
            f"    UNPADDED = Unpadded(input={spec['input']!r},",
            f"                        like={tuple(tuple(size) for size in spec['like'])!r},",
            f"                        masks={tuple(spec['masks'])!r}, causal={spec['causal']!r},",
            f"                        start={spec['start']!r})"]


def _module_header(ir: dict, guards: str, table: str, fused: bool, grouped: bool) -> list[str]:
    """The generated module's docstring (its gate table) and imports."""
    return [
        f'"""Generated by rbcompile from {ir["title"]}.',
        "",
        "Do not edit: `rbcompile.load` regenerates this file from graph.json and refuses to run it",
        "if the two differ.",
        "",
        f"Regions: {len(ir['regions'])}; gates (one per prunable region):",
        table,
        '"""',
        "import operator",
        "",
        "import torch",
        "",
        *(["import rbcompile.kernels  # noqa: F401  (registers the fused kernels)"] if fused else []),
        "from rbcompile.artifact.region_cache import RegionCache",
        ("from rbcompile.artifact.regions import Region, Unpadded, run_regions" if ir.get("unpadded")
         else "from rbcompile.artifact.regions import Region, run_regions"),
        *([f"from rbcompile.{'frontend.onnx_export' if guards == 'cond' else 'artifact.attention'} "
           f"import {GROUPED_ATTENTION}"] if grouped else []),
        "",
        ("from rbcompile.frontend.onnx_export import EXPORT_ATEN as aten" if guards == "cond"
         else "aten = torch.ops.aten"),
        "prims = torch.ops.prims",
        *([f"rbcompile_ops = {'rbcompile.kernels.REFERENCES' if guards == 'cond' else 'torch.ops.rbcompile'}"]
          if fused else []),
    ]


def generate_source(ir: dict, guards: str = "python") -> str:
    """Python source of the generated module for a validated IR: gates as Python bools
    (`guards="python"`, the artifact's model.py) or as `torch.cond`s on a bool tensor ("cond");
    see rbcompile/artifact/regions.py."""
    check_ir(ir)
    grouped = bool(ir.get("grouped_attention"))
    if grouped:
        ir = _route_grouped_attention(ir)
    variants = sorted(ir.get("variants", []), key=lambda v: -v["ratio"])
    params = {**ir["parameters"], **{n: v for var in variants for n, v in var["parameters"].items()}}
    by_region: dict[int, list] = {}
    for node in ir["nodes"]:
        by_region.setdefault(node[4], []).append(node)
    prunable = [r for r in ir["regions"] if r["kind"] == "prunable"]
    table = "\n".join(f"  gate {r['gate']:>3} -> region {r['id']:>3} {r['unit_kind']:<9} "
                      f"{r['name']} ({r['prunable_share']:.1%} of prunable FLOPs)"
                      for r in prunable)
    fused = any(node[1].startswith(KERNELS)
                for node in [*ir["nodes"], *(n for v in variants for n in v["nodes"])])
    param_lines = "\n".join(f"        {name!r}: {key!r}," for name, key in ir["parameters"].items())
    view_lines = "\n".join(f"        {name!r}: ({v['key']!r}, {v['axis']!r}, {v['length']!r}),"
                           for var in variants for name, v in var["parameters"].items())
    lines = [
        *_module_header(ir, guards, table, fused, grouped),
        "",
        "",
        "class GeneratedModel(torch.nn.Module):",
        f"    INPUTS = {tuple(ir['inputs'])!r}",
        f"    OUTPUTS = {tuple(name for name, _ in ir['outputs'])!r}",
        f"    NUM_GATES = {len(prunable)}",
        "    # buffer name -> key in weights.safetensors",
        "    PARAMETERS = {",
        param_lines,
        "    }",
        *_concatenated(ir.get("concatenated", {})),
        *_unpadded(ir.get("unpadded")),
        "    # buffer name -> (weights key, axis, length): narrowed views for width levels",
        "    PARAMETER_VIEWS = {",
        *([view_lines] if view_lines else []),
        "    }",
        f"    WIDTH_LEVELS = {tuple(v['ratio'] for v in variants)!r}",
        "    # the regions in run order, as rbcompile/artifact/regions.py runs them: methods, gates, the",
        "    # input a skipped region passes on, width levels (widest first), values dropped after",
        *_table(ir, variants),
        "",
        "    def __init__(self):",
        "        super().__init__()",
        "        self.region_cache = RegionCache()",
        "",
        "    @property",
        "    def device(self):",
        "        return next(iter(self._buffers.values())).device",
        "",
        *_forward(ir, guards),
    ]
    taken = {*params, *ir["inputs"], *(node[0] for node in ir["nodes"])}
    for region in ir["regions"]:
        lines += [""] + _region_method(region, by_region.get(region["id"], []), params)
        for variant in _levels(region, variants):
            nodes = [n for n in variant["nodes"] if n[4] == region["id"]]
            lines += [""] + _region_method(region, nodes, params, variant)
        lines += _seam_methods(ir, region, by_region.get(region["id"], []), params, taken)
    return "\n".join(lines) + "\n"
