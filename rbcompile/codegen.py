"""Generate the runtime module's Python source from the IR (see ir.py).

The generated class has one method per region and a `forward` that runs the skeleton regions
always, serves cache-reuse regions from a shape-keyed cache, and runs each prunable region only
when its gate is on (otherwise its output is the residual stream it reads: an identity).

With `guards="cond"` (ONNX export only, never saved) each gate is a `torch.cond` on a bool
tensor `gates[i]`, which exports as an ONNX `If`; cache regions are computed directly and the
width levels are chosen by Python comparisons, so a given `widths` list is baked in; fused
kernels (`rbcompile.*` ops) call their PyTorch references, which export as plain ONNX.
"""
from __future__ import annotations

from .ir import check_ir

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


def _with_deletes(statements: list[tuple[str, list[str]]], keep: set[str], indent: str) -> list[str]:
    """Lines for (code, names read) statements, deleting each name after its last read."""
    last_read = {}
    for index, (_, reads) in enumerate(statements):
        for name in reads:
            last_read[name] = index
    lines = []
    for index, (code, reads) in enumerate(statements):
        lines.extend(indent + line for line in code.split("\n"))
        if code.startswith("return"):
            continue
        dead = [n for n in dict.fromkeys(reads) if last_read[n] == index and n not in keep]
        if dead:
            lines.append(f"{indent}del {', '.join(dead)}")
    return lines


def _reads(value, params) -> list[str]:
    if isinstance(value, dict):
        (key, inner), = value.items()
        if key == "node":
            return [] if inner in params else [inner]
        return _reads(inner, params) if key == "tuple" else []
    if isinstance(value, list):
        return [name for v in value for name in _reads(v, params)]
    return []


def method_name(region: dict) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in region["name"]).strip("_")
    return f"r{region['id']}_{safe}"[:60]


def _tuple(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names)


def _region_method(region: dict, nodes: list, params, variant: dict | None = None) -> list[str]:
    """A region's method; for a width variant, its narrowed twin (same region id and role)."""
    if variant is None:
        header = (f"{_INDENT}# region {region['id']}: {region['kind']}"
                  f"{' (' + region['unit_kind'] + ')' if region['kind'] == 'prunable' else ''}"
                  f", {region['module_path']}, {region['flops_share']:.2%} of FLOPs")
        name, inputs, outputs = method_name(region), region["inputs"], region["outputs"]
    else:
        spec = variant["regions"][str(region["id"])]
        header = (f"{_INDENT}# region {region['id']} at width {variant['ratio']:g}: "
                  f"{region['module_path']}, {spec['prunable_share']:.2%} of prunable FLOPs")
        name = f"{method_name(region)}_{variant['label']}"
        inputs, outputs = spec["inputs"], spec["outputs"]
    lines = [header, f"{_INDENT}def {name}(self, {', '.join(inputs)}):"]
    statements = []
    for name, op, args, kwargs, _ in nodes:
        reads = _reads(args, params) + _reads(list(kwargs.values()), params)
        statements.append((f"{name} = {_call(op, args, kwargs, params)}", reads))
    statements.append((f"return {_tuple(outputs)}", outputs))
    lines += _with_deletes(statements, set(), _INDENT * 2)
    return lines


_COND = '''

def _cond(gate, branch, stream, operands):
    """torch.cond on the bool tensor `gate`: `branch(*operands)`, or a copy of `operands[stream]`
    (branch outputs must not alias inputs). cond takes tensor operands only, so the sizes
    (SymInts) among `operands` travel as the shape of an empty tensor."""
    is_size = [not isinstance(value, torch.Tensor) for value in operands]
    sizes = [value for value, size in zip(operands, is_size) if size]
    tensors = [value for value, size in zip(operands, is_size) if not size]
    carrier = operands[stream].new_empty((0, *sizes))

    def run(carrier, *tensors):
        sizes, tensors = iter(carrier.shape[1:]), iter(tensors)
        return branch(*(next(sizes) if size else next(tensors) for size in is_size))

    def skip(carrier, *tensors):
        return tensors[stream - sum(is_size[:stream])].clone()

    return torch.cond(gate, run, skip, (carrier, *tensors))
'''.split("\n")


def _width_choice(gate: int, levels: list[dict], assign) -> list[str]:
    """Lines choosing full width or the narrowest level (`levels` widest first) whose width is
    >= `widths[gate]` (requests below the lowest level are clamped to it: the floor);
    `assign(suffix)` is the statement for the method with that suffix."""
    lines = [f"if widths is None or widths[{gate}] > {levels[0]['ratio']!r}:",
             f"{_INDENT}{assign('')}"]
    for index, variant in enumerate(levels):
        lines += [f"elif widths[{gate}] > {levels[index + 1]['ratio']!r}:"
                  if index + 1 < len(levels) else "else:",
                  f"{_INDENT}{assign('_' + variant['label'])}"]
    return lines


def _prunable_call(region: dict, variants: list[dict], guards: str) -> str:
    """The guarded call of a prunable region: skipped (its output is the stream it reads), full,
    or a width level (see `_width_choice`). With `guards="cond"`, a `torch.cond` on the gate
    tensor between the chosen method and a copy of that stream."""
    (out, stream_in), = region["skip"].items()
    gate, inputs, method = region["gate"], region["inputs"], method_name(region)
    args = f"({', '.join(inputs)})"
    levels = [v for v in variants if str(region["id"]) in v["regions"]]
    if guards == "cond":
        stream_and_operands = f"{inputs.index(stream_in)}, ({', '.join(inputs)},))"
        if not levels:
            return f"{out} = _cond(gates[{gate}], self.{method}, {stream_and_operands}"
        choice = _width_choice(gate, levels, lambda suffix: f"branch = self.{method}{suffix}")
        return "\n".join(choice + [f"{out} = _cond(gates[{gate}], branch, {stream_and_operands}"])
    if not levels:
        return (f"if gates[{gate}]:\n{_INDENT}{out} = self.{method}{args}\n"
                f"else:\n{_INDENT}{out} = {stream_in}")
    choice = _width_choice(gate, levels, lambda suffix: f"{out} = self.{method}{suffix}{args}")
    return "\n".join([f"if gates[{gate}]:", *(_INDENT + line for line in choice),
                      "else:", f"{_INDENT}{out} = {stream_in}"])


def _forward(ir: dict, guards: str) -> list[str]:
    variants = sorted(ir.get("variants", []), key=lambda v: -v["ratio"])
    statements = []
    for region in ir["regions"]:
        method, inputs, outputs = method_name(region), region["inputs"], region["outputs"]
        call = f"self.{method}({', '.join(inputs)})"
        if region["kind"] == "cache" and guards == "python":
            args = ", ".join([str(region["id"]), f"self.{method}", *inputs])
            code = f"{_tuple(outputs)}{',' if len(outputs) == 1 else ''} = self.region_cache.lookup({args})"
        elif region["kind"] == "prunable":
            code = _prunable_call(region, variants, guards)
        else:
            code = f"{_tuple(outputs)} = {call}"
        statements.append((code, inputs))
    results = [name for _, name in ir["outputs"]]
    statements.append((f"return ({', '.join(results)},)", results))
    inputs = ", ".join(ir["inputs"])
    return ([f"{_INDENT}def forward(self, {inputs}, gates, widths=None):",
             f'{_INDENT * 2}"""Run the model; `gates[i]` turns prunable region i on (True) or off;',
             f'{_INDENT * 2}`widths[i]` (optional) narrows it to the smallest width level >= it."""']
            + _with_deletes(statements, set(), _INDENT * 2))


def generate_source(ir: dict, guards: str = "python") -> str:
    """Python source of the generated module for a validated IR: gates as Python `if`s
    (`guards="python"`, the artifact's model.py) or as `torch.cond`s on a bool tensor ("cond")."""
    check_ir(ir)
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
        "from rbcompile.region_cache import RegionCache",
        "",
        "aten = torch.ops.aten",
        "prims = torch.ops.prims",
        *([f"rbcompile_ops = {'rbcompile.kernels.REFERENCES' if guards == 'cond' else 'torch.ops.rbcompile'}"]
          if fused else []),
        "",
        *(_COND if guards == "cond" else []),
        "",
        "class GeneratedModel(torch.nn.Module):",
        f"    INPUTS = {tuple(ir['inputs'])!r}",
        f"    OUTPUTS = {tuple(name for name, _ in ir['outputs'])!r}",
        f"    NUM_GATES = {len(prunable)}",
        "    # buffer name -> key in weights.safetensors",
        "    PARAMETERS = {",
        param_lines,
        "    }",
        "    # buffer name -> (weights key, axis, length): narrowed views for width levels",
        "    PARAMETER_VIEWS = {",
        *([view_lines] if view_lines else []),
        "    }",
        f"    WIDTH_LEVELS = {tuple(v['ratio'] for v in variants)!r}",
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
    for region in ir["regions"]:
        lines += [""] + _region_method(region, by_region.get(region["id"], []), params)
        for variant in variants:
            if str(region["id"]) in variant["regions"]:
                nodes = [n for n in variant["nodes"] if n[4] == region["id"]]
                lines += [""] + _region_method(region, nodes, params, variant)
    return "\n".join(lines) + "\n"
