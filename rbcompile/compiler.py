"""`compile`: checkpoint -> traced graph -> passes -> IR -> generated module with weights."""
from __future__ import annotations

import hashlib
import operator

import torch

from . import __version__
from .codegen import generate_source
from .errors import UserError
from .ir import build_ir
from .module import attach_weights, instantiate
from .architectures import lookup
from .models import checkpoint_sha256, load_hf_model, load_tokenizer, resolve_checkpoint
from .passes import CALIBRATED_PIPELINE, PIPELINE, PassContext, run_pipeline
from .passes.annotate_flops import REFERENCE_SEQ
from .progress import say, step
from .width import DEFAULT_LEVELS
from .placement import dtype_name, parse_device, parse_dtype
from .trace import example_inputs, model_placement, trace


def generate_module(gm, regions: list[dict], input_names, output_names, title: str):
    """(IR, source, module with the graph's weights) for a graph the passes have run on."""
    ir = build_ir(gm, regions, input_names, output_names)
    ir["title"] = title
    source = generate_source(ir)
    module = instantiate(source, title)
    attach_weights(module, {key: operator.attrgetter(key)(gm) for key in ir["parameters"].values()})
    return ir, source, module


def architecture_summary(model) -> dict:
    """The manifest's `architecture` section."""
    architecture = lookup(model.config)
    dims = architecture.dimensions(model.config)
    return {"model_type": architecture.model_type, "family": architecture.family,
            "class": type(model).__name__, "layers": dims.layers, "hidden_size": dims.hidden,
            "vocab_size": dims.vocab}


def _state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


CALIBRATION_DEFAULTS = {"decoder": {"samples": 8, "seq": 256, "batch": 4},
                        "encoder": {"samples": 256, "seq": 128, "batch": 32}}


def add_width_levels(compiled, ctx, eager, levels) -> None:
    """Trace the narrowed width levels and regenerate the module with their methods."""
    from .plans import width_shares
    from .width import build_variant

    variants = []
    for ratio in levels:
        with step(f"tracing width level {ratio:g}"):
            variant = build_variant(eager, compiled, ctx, ratio)
        if variant:
            variants.append(variant)
    if not variants:
        return
    compiled.ir["variants"] = variants
    compiled.source = generate_source(compiled.ir)
    weights = {key: compiled.module.get_buffer(name)
               for name, key in compiled.module.PARAMETERS.items()}
    compiled.module = instantiate(compiled.source, compiled.manifest["source"]["name"])
    attach_weights(compiled.module, weights)
    compiled.width_shares = width_shares(variants)


def check_width_levels(levels, floor: float) -> tuple[float, ...]:
    levels = tuple(sorted({float(level) for level in levels}, reverse=True))
    if not 0 < floor <= 1:
        raise UserError(f"width floor must be in (0, 1], got {floor}")
    bad = [level for level in levels if not floor <= level < 1]
    if bad:
        raise UserError(f"width levels must be in [{floor:g}, 1) (the floor is {floor:g}), got {bad}")
    return levels


def calibrate_model(compiled, gm, ctx, eager, source, samples: int | None = None,
                    seq: int | None = None, width_levels=DEFAULT_LEVELS,
                    width_floor: float = 0.5, head_path=None) -> None:
    """Measure region and head/channel importance, reorder heads and channels by importance
    (CALIBRATED_PIPELINE), add width levels, and choose verified plans; all of it goes into
    the manifest."""
    from .calibrate import Evaluator, build_plans, measure_importance, measure_width_importance
    from .calibration_data import load_labelled, make_batches
    from .quality import load_head

    defaults = CALIBRATION_DEFAULTS[compiled.family]
    samples, seq = samples or defaults["samples"], seq or defaults["seq"]
    if samples < 2 or seq < 2:
        raise UserError("--calib-samples and --calib-seq must be >= 2")
    width_levels = check_width_levels(width_levels, width_floor)
    seq = min(seq, compiled.max_positions)
    texts, labels = load_labelled(source)
    head = load_head(head_path) if head_path else None
    if head is not None and (compiled.family != "encoder" or labels is None):
        raise UserError("--calib-head needs an encoder and JSONL calibration data with an "
                        "integer \"label\" on every line")
    batches = make_batches(compiled.tokenizer, texts, compiled.family, seq_len=seq,
                           samples=samples, batch_size=defaults["batch"],
                           labels=labels if head is not None else None)
    say(f"calibrating on {source}: {sum(len(b[0]) for b in batches.calibration)} samples x <= "
        f"{seq} tokens, {sum(len(b[0]) for b in batches.heldout)} held out")
    with step("measuring head and channel importance (gradients)"):
        ctx.width_importance = measure_width_importance(eager, ctx.units, compiled.family,
                                                        batches.calibration,
                                                        batches.calibration_labels, head)
    run_pipeline(gm, ctx, CALIBRATED_PIPELINE)
    add_width_levels(compiled, ctx, eager, width_levels)
    with step("measuring each region skipped and at each width level"):
        calib = Evaluator(compiled, batches.calibration, batches.calibration_labels, head)
        importance = measure_importance(compiled, calib)
    with step("choosing and verifying plans on held-out text"):
        heldout = Evaluator(compiled, batches.heldout, batches.heldout_labels, head)
        plans = build_plans(compiled, importance, calib, heldout)
    compiled.manifest["calibration"] = {"source": str(source), "samples": samples, "seq": seq,
                                        "loss": ("task head " + str(head_path)) if head else
                                        ("next-token" if compiled.family == "decoder" else
                                         "1 - cosine to the full path"),
                                        **importance, "width": ctx.width_importance,
                                        "permutations": ctx.permutations}
    compiled.manifest["plans"] = compiled.plans = plans
    if head is not None:
        from .runtime.early_exit import train_offramps
        with step("training early-exit off-ramps"):
            compiled.offramps = train_offramps(compiled, batches.calibration, batches.heldout, head)
        say(f"  off-ramps after layers {compiled.offramps.layers}, exit threshold "
            f"{compiled.offramps.threshold:.3f}")


def compile_model(model_or_path, *, dump_pass: str | None = None, calib=None,
                  calib_samples: int | None = None, calib_seq: int | None = None,
                  width_levels=DEFAULT_LEVELS, width_floor: float = 0.5, calib_head=None,
                  kernels: bool = False, device=None, dtype=None):
    """Compile a bundled model name, a checkpoint folder or a loaded transformers model;
    with `calib` (a text source), also calibrate importance and budget plans; with `kernels`,
    fuse norms and activations into rbcompile's kernels (passes/fuse_kernels.py).

    `dtype` (fp32 / bf16 / fp16; default: the model's own, fp32 for checkpoints) is the
    precision the graph is traced and runs in; `device` where it is traced and placed (a loaded
    model is moved there, like `nn.Module.to`)."""
    from .compiled import CompiledModel

    device, dtype = parse_device(device), parse_dtype(dtype)
    if isinstance(model_or_path, torch.nn.Module):
        if calib is not None:
            raise UserError("calibrating needs a tokenizer: compile a checkpoint folder or a "
                            "bundled name, not a loaded module")
        model, checkpoint = model_or_path.eval(), None
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        source = {"name": type(model).__name__, "path": None, "sha256": _state_sha256(model)}
    else:
        checkpoint = resolve_checkpoint(model_or_path)
        if calib is not None:  # before minutes of work: calibration text needs the tokenizer
            load_tokenizer(checkpoint)
        with step(f"loading {model_or_path}"):
            model = load_hf_model(checkpoint, dtype).to(device or "cpu")
        source = {"name": str(model_or_path), "path": str(checkpoint.resolve()),
                  "sha256": checkpoint_sha256(checkpoint)}
    model_device, model_dtype = model_placement(model)
    architecture = lookup(model.config)
    arch = architecture_summary(model)
    arch["dtype"] = dtype_name(model_dtype)
    with step(f"tracing {arch['class']} with torch.export (dynamic batch and sequence)"):
        traced = trace(model, architecture)
    arch["max_positions"] = traced.max_positions
    reference = example_inputs(architecture, arch["vocab_size"], batch=1,
                               seq=min(REFERENCE_SEQ, traced.max_positions), device=model_device)
    reference[architecture.mask_input].fill_(1)
    ctx = PassContext(family=architecture.family, reference_inputs=reference,
                      input_names=traced.input_names, architecture=architecture,
                      dims=architecture.dimensions(model.config), dump_pass=dump_pass,
                      kernels=kernels)
    gm = traced.graph_module
    with step(f"running {len(PIPELINE)} passes"):
        run_pipeline(gm, ctx)
    ir, source_code, module = generate_module(
        gm, ctx.regions, traced.input_names, traced.output_names,
        f"{source['name']} ({arch['class']}, rbcompile {__version__})")
    manifest = {"source": source, "architecture": arch, "passes": ctx.history,
                "cache_candidates": ctx.cache_candidates}
    compiled = CompiledModel(module, ir, source_code, manifest,
                             tokenizer_dir=checkpoint, hf_config=model.config.to_dict())
    if calib is not None:
        calibrate_model(compiled, gm, ctx, model, calib, calib_samples, calib_seq,
                        width_levels, width_floor, calib_head)
    return compiled
