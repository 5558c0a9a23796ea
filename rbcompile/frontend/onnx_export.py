"""Export a CompiledModel to ONNX and run it with onnxruntime under the same gates.

The export runs the module generated with `guards="cond"` (codegen.py): each prunable region is
a `torch.cond` on `gates[i]`, a bool tensor graph input of shape [num_gates], and becomes an ONNX
`If` whose else branch is a single copy of the residual stream. Width levels are baked in: the
widths of the plan of `budget` (none: full width). The file is written to a temporary sibling,
validated by onnxruntime in a subprocess (so a crash there cannot take the exporter down) and
only then renamed into place.

`python -m rbcompile.frontend.onnx_export MODEL.onnx CASES_DIR` is that subprocess: it prints a JSON report.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rbcompile.artifact.ort_threads import session_options
from rbcompile.errors import first_line

# Deferred on purpose: torch, onnx, onnxruntime and the compiler load inside the functions;
# the CLI's parser reads this module's constants at start, before torch loads.

INPUT_NAMES = ("input_ids", "attention_mask", "gates")
OPSETS = range(18, 24)          # torch's ONNX exporter starts at 18; onnxruntime 1.2x reads <= 23
EXAMPLE_SHAPE = (2, 16)         # batch x sequence traced (the fixed shape with dynamic=False)
VALIDATION_SHAPES = ((3, 11), (1, 6), (2, 9))
ATOL, RTOL = 1e-4, 1e-5  # |onnx - torch| <= ATOL + RTOL * max |torch| of that output
VALIDATION_BUDGET = 0.3


@dataclass
class OnnxReport:
    """What `export_onnx` wrote and what validation measured."""
    path: Path
    opset: int
    dynamic: bool
    widths: list[float] | None             # baked width per gate (None: full width)
    if_nodes: int = 0
    branch_nodes: tuple[int, int] = (0, 0)  # nodes in the largest then / else branch
    max_diffs: dict[str, float] = field(default_factory=dict)  # setting -> max abs diff
    seconds: float = 0.0


def graph_digest(compiled) -> str:
    """Identifies the IR an ONNX file was exported from (stored in its metadata)."""
    return hashlib.sha256(json.dumps(compiled.ir, sort_keys=True).encode()).hexdigest()


def check_opset(opset) -> int:
    from rbcompile.errors import UserError
    if not isinstance(opset, int) or opset not in OPSETS:
        raise UserError(f"opset must be an integer in [{OPSETS.start}, {OPSETS.stop - 1}], "
                        f"got {opset!r}")
    return opset


def baked_widths(compiled, budget: float | None) -> list[float] | None:
    """The widths of `budget`'s plan (None: no budget, or the plan narrows nothing)."""
    from rbcompile.artifact.plans import check_budget
    from rbcompile.errors import UserError
    if budget is None:
        return None
    try:
        budget = check_budget(budget)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return compiled.plan_for_budget(budget)[1]


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False):
    """SDPA with torch's result for a query row whose every key is masked (-inf): 0. The
    exporter's attention with an additive float mask (`share_attention_masks` gives every
    attention one) gives NaN there, and a padded row's NaN reaches the others through the next
    layer's keys. Only those rows are zeroed: a NaN the inputs carry passes on, as in torch."""
    import torch

    out = torch.ops.aten.scaled_dot_product_attention.default(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return out  # the exporter's bool-mask attention already gives 0
    fully_masked = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)
    return torch.where(fully_masked, torch.zeros((), dtype=out.dtype, device=out.device), out)


def grouped_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                      scale=None):
    """The exported attention over grouped K/V heads: SDPA's `enable_gqa` (the artifact's
    rbcompile/artifact/attention.py chooses a form per call, which an exported graph cannot)."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                      enable_gqa=True)


class _ExportAten:
    """`torch.ops.aten` for the module the ONNX export traces (codegen's `guards="cond"`),
    with the attention above."""
    scaled_dot_product_attention = types.SimpleNamespace(default=_attention)

    def __getattr__(self, name):
        import torch

        return getattr(torch.ops.aten, name)


EXPORT_ATEN = _ExportAten()


def _cond_module(compiled, widths):
    """The cond-guarded twin of `compiled.module` sharing its weights, as a module taking
    (input_ids, attention_mask, gates)."""
    import torch

    from rbcompile.artifact.codegen import generate_source
    from rbcompile.artifact.module import attach_weights, instantiate, weights

    inner = instantiate(generate_source(compiled.ir, guards="cond"), "cond")
    # a weight the decoder stacks is a view of the stack here: torch.export's cond refuses
    # buffers that alias each other, so those are copied
    attach_weights([inner], {key: tensor.clone() if tensor._base is not None else tensor
                             for key, tensor in weights(compiled.module).items()})

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, gates):
            return self.inner(input_ids, attention_mask, gates, widths)

    return Gated().eval()


def _example(compiled, shape):
    import torch
    batch, seq = shape[0], min(shape[1], compiled.max_positions)
    generator = torch.Generator().manual_seed(batch * 1000 + seq)
    input_ids = torch.randint(0, compiled.vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        attention_mask[-1, : seq // 3] = 0  # a padded row
    return input_ids, attention_mask


def _to_onnx(compiled, widths, opset: int, dynamic: bool):
    """An ONNXProgram of the cond-guarded module, with rbcompile metadata."""
    import logging
    import warnings

    import torch

    from rbcompile.compiler.trace import export_or_retry

    input_ids, attention_mask = _example(compiled, EXAMPLE_SHAPE)
    gates = torch.ones(compiled.num_gates, dtype=torch.bool)

    def dynamic_shapes(dim=None):  # named axes, or `dim` (Dim.DYNAMIC) for both
        if not dynamic:
            return None
        axes = {0: dim or torch.export.Dim("batch"),
                1: dim or torch.export.Dim("sequence", max=compiled.max_positions)}
        return {"input_ids": axes, "attention_mask": axes, "gates": None}

    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            module = _cond_module(compiled, widths)
            warnings.simplefilter("ignore")  # torchvision absent, pytree deprecations, axis names
            program = export_or_retry(lambda dim: torch.export.export(
                module, (input_ids, attention_mask, gates), dynamic_shapes=dynamic_shapes(dim)),
                "the ONNX module")
            shapes = dynamic_shapes()
            onnx_program = torch.onnx.export(program, dynamic_shapes=shapes,  # names the axes
                                             input_names=list(INPUT_NAMES),
                                             output_names=compiled.output_names,
                                             opset_version=opset, dynamo=True, verbose=False)
    finally:
        logger.setLevel(level)
    onnx_program.model.metadata_props.update({
        "rbcompile.graph_sha256": graph_digest(compiled),
        "rbcompile.num_gates": str(compiled.num_gates),
        "rbcompile.widths": json.dumps(widths)})
    return onnx_program


def validation_settings(compiled) -> dict[str, list[bool]]:
    """Gate settings validation compares: all on, the middle layer off, the plan of budget 0.3."""
    prunable = sorted((r for r in compiled.regions if r["kind"] == "prunable"),
                      key=lambda r: r["gate"])
    layers = sorted({r["layer"] for r in prunable})
    middle = layers[len(layers) // 2]
    return {"all on": [True] * compiled.num_gates,
            f"layer {middle} off": [r["layer"] != middle for r in prunable],
            f"budget {VALIDATION_BUDGET} plan": compiled.gates_for_budget(VALIDATION_BUDGET)}


def _branch_sizes(onnx_program) -> tuple[int, list[tuple[int, int]]]:
    """(If nodes, [(then nodes, else nodes)]) of the top-level graph."""
    sizes = [(len(list(node.attributes["then_branch"].value)),
              len(list(node.attributes["else_branch"].value)))
             for node in onnx_program.model.graph if node.op_type == "If"]
    return len(sizes), sizes


def validate_onnx(compiled, path, widths, dynamic: bool) -> dict[str, float]:
    """Run the ONNX file at `path` with onnxruntime in a subprocess on each validation setting
    (a different input shape each when dynamic) and compare with `compiled`; returns the max
    abs diff per setting. UserError if the checker, names, axes, shapes or values disagree."""
    import numpy as np

    from rbcompile.errors import UserError

    settings = validation_settings(compiled)
    shapes = VALIDATION_SHAPES if dynamic else [EXAMPLE_SHAPE] * len(settings)
    with tempfile.TemporaryDirectory(prefix="rbcompile-validate-") as tmp:
        arrays = {}
        for index, (gates, shape) in enumerate(zip(settings.values(), shapes)):
            input_ids, attention_mask = _example(compiled, shape)
            out = compiled(input_ids, attention_mask, gates=gates, widths=widths)
            arrays.update({f"{index}.input_ids": input_ids.numpy(),
                           f"{index}.attention_mask": attention_mask.numpy(),
                           f"{index}.gates": np.array(gates),
                           **{f"{index}.out.{k}": v.numpy() for k, v in out.items()}})
        np.savez(Path(tmp) / "cases.npz", **arrays)
        (Path(tmp) / "spec.json").write_text(json.dumps(
            {"settings": list(settings), "outputs": compiled.output_names, "dynamic": dynamic,
             "atol": ATOL, "rtol": RTOL}))
        # run in `tmp`: `python -m` puts its working directory first on sys.path, and a
        # checkout's kernels/ there would shadow Hugging Face's kernels (rbcompile/child.py)
        proc = subprocess.run([sys.executable, "-m", "rbcompile.frontend.onnx_export",
                               str(Path(path).resolve()), tmp],
                              capture_output=True, text=True, cwd=tmp)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"ONNX validation crashed (exit {proc.returncode}): {last}") from None
    if result["error"]:
        raise UserError(f"ONNX validation failed: {result['error']}")
    return result["max_diffs"]


def _check(model_path: str, cases: Path) -> dict:
    """The validation subprocess: {"error": message or None, "max_diffs": {setting: diff}}."""
    import numpy as np
    import onnx
    import onnxruntime

    spec = json.loads((cases / "spec.json").read_text())
    arrays = np.load(cases / "cases.npz")
    diffs: dict[str, float] = {}

    def failed(message):
        return {"error": message, "max_diffs": diffs}

    try:
        onnx.checker.check_model(model_path, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        return failed(f"onnx.checker: {first_line(exc)}")
    session = onnxruntime.InferenceSession(model_path, session_options(spinning=False),
                                           providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    if inputs != list(INPUT_NAMES) or outputs != spec["outputs"]:
        return failed(f"graph inputs {inputs} / outputs {outputs}, expected "
                      f"{list(INPUT_NAMES)} / {spec['outputs']}")
    declared = {i.name: i.shape for i in [*session.get_inputs(), *session.get_outputs()]}
    if spec["dynamic"]:
        fixed = [name for name in INPUT_NAMES[:2] if not all(isinstance(d, str)
                                                             for d in declared[name])]
        if fixed:
            return failed(f"{fixed[0]} has fixed axes {declared[fixed[0]]}, expected dynamic "
                          "batch and sequence")
    seen_shapes: dict[str, set] = {name: set() for name in outputs}
    for index, setting in enumerate(spec["settings"]):
        feeds = {name: arrays[f"{index}.{name}"] for name in INPUT_NAMES}
        valid = feeds["attention_mask"].astype(bool)
        diffs[setting] = 0.0
        for name, got in zip(outputs, session.run(None, feeds)):
            want = arrays[f"{index}.out.{name}"]
            if got.shape != want.shape:
                return failed(f"{setting}: {name} has shape {list(got.shape)}, PyTorch "
                              f"{list(want.shape)}")
            seen_shapes[name].add(got.shape)
            keep = valid if got.shape[:2] == valid.shape else ...  # padded positions are undefined
            error = np.abs(got[keep] - want[keep])
            diffs[setting] = max(diffs[setting], float(error.max()))
            allowed = spec["atol"] + spec["rtol"] * float(np.abs(want[keep]).max())
            if not error.max() <= allowed:
                return failed(f"{setting}: {name} differs by up to {error.max():.3g} (allowed: "
                              f"{spec['atol']:g} + {spec['rtol']:g} x its largest |value|)")
    for name, shapes in seen_shapes.items():
        varying = [axis for axis, sizes in enumerate(zip(*shapes)) if len(set(sizes)) > 1]
        if any(not isinstance(declared[name][axis], str) for axis in varying):
            return failed(f"output {name} declares fixed axes {declared[name]}")
    return {"error": None, "max_diffs": diffs}


def export_onnx(compiled, path, *, opset: int = 20, dynamic: bool = True,
                budget: float | None = None, validate: bool = True) -> OnnxReport:
    """Write `compiled` as an ONNX model at `path`: gates are the bool tensor input `gates`
    ([num_gates]) and every prunable region an `If`; `budget` bakes that plan's width levels.
    Written to a temporary sibling and, unless `validate=False`, checked against PyTorch by
    onnxruntime in a subprocess before it replaces `path`."""
    from rbcompile.artifact.atomic import write_file
    from rbcompile.errors import UserError
    from rbcompile.progress import step

    start = time.perf_counter()
    opset = check_opset(opset)
    widths = baked_widths(compiled, budget)
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give the .onnx file to write")
    axes = "dynamic batch and sequence" if dynamic else "fixed %d x %d input" % EXAMPLE_SHAPE
    baked = (f", widths of budget {budget:g} baked in" if widths else
             f", budget {budget:g}'s plan narrows nothing" if budget is not None else "")
    with step(f"exporting to ONNX (opset {opset}, {axes}{baked})"):
        program = _to_onnx(compiled, widths, opset, dynamic)
    report = OnnxReport(path, opset, dynamic, widths)
    report.if_nodes, sizes = _branch_sizes(program)
    report.branch_nodes = tuple(max(column, default=0) for column in zip(*sizes)) or (0, 0)

    def write(tmp: Path) -> None:
        program.save(str(tmp), external_data=False)
        if validate:
            with step("validating with onnxruntime in a subprocess"):
                report.max_diffs = validate_onnx(compiled, tmp, widths, dynamic)

    write_file(path, write)
    report.seconds = time.perf_counter() - start
    return report


class OnnxRunner:
    """An exported .onnx run by onnxruntime, called like the CompiledModel it was exported from
    (same input checks, gate choice and CompiledOutput)."""

    def __init__(self, compiled, path, threads: int | None = None):
        import onnxruntime

        from rbcompile.errors import UserError

        path = Path(path)
        if not path.is_file():
            raise UserError(f"no such ONNX file: {path}")
        try:
            # idle workers sleep instead of spinning: torch work between runs keeps its cores
            self.session = onnxruntime.InferenceSession(str(path),
                                                        session_options(threads, spinning=False),
                                                        providers=["CPUExecutionProvider"])
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"{path}: cannot load the ONNX model ({reason})") from None
        metadata = self.session.get_modelmeta().custom_metadata_map
        if metadata.get("rbcompile.graph_sha256") != graph_digest(compiled):
            raise UserError(f"{path} was not exported from this artifact; export it with "
                            "`rbcompile export-onnx`")
        self.compiled = compiled
        self.path = path
        self.widths = json.loads(metadata.get("rbcompile.widths", "null"))
        shape = self.session.get_inputs()[0].shape
        self.fixed_shape = None if any(isinstance(d, str) for d in shape) else tuple(shape)

    def __call__(self, input_ids, attention_mask=None, *, budget=None, gates=None):
        import numpy as np
        import torch

        from rbcompile.errors import UserError

        compiled = self.compiled
        input_ids, attention_mask, _ = compiled._check_inputs(input_ids, attention_mask)
        if self.fixed_shape and tuple(input_ids.shape) != self.fixed_shape:
            raise UserError(f"{self.path} takes inputs of the fixed shape {list(self.fixed_shape)}"
                            f", got {list(input_ids.shape)}; export it without --no-dynamic-axes")
        chosen = compiled.choose_gates(input_ids, attention_mask, budget, gates)
        gates, widths = chosen.gates, chosen.widths
        if widths != self.widths:
            raise UserError(f"{self.path} bakes the widths {self.widths} but this input asks for "
                            f"{widths}; export it with the --budget you run")
        outputs = self.session.run(None, {"input_ids": input_ids.numpy(),
                                          "attention_mask": attention_mask.numpy(),
                                          "gates": np.array(gates)})
        return chosen.output({name: torch.from_numpy(value)
                              for name, value in zip(compiled.output_names, outputs)},
                             compiled.skipped_share(gates, widths))


@contextmanager
def onnx_engine(compiled, onnx_path=None, budget: float | None = None):
    """An OnnxRunner for `onnx_path`, or for a validated export (baking `budget`'s widths) to
    a temporary folder removed afterwards."""
    if onnx_path is not None:
        yield OnnxRunner(compiled, onnx_path)
        return
    with tempfile.TemporaryDirectory(prefix="rbcompile-onnx-") as tmp:
        report = export_onnx(compiled, Path(tmp) / "model.onnx", budget=budget)
        yield OnnxRunner(compiled, report.path)


if __name__ == "__main__":
    print(json.dumps(_check(sys.argv[1], Path(sys.argv[2]))))
