"""`compile`: checkpoint -> traced graph -> passes -> IR -> generated module with weights."""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch

from rbcompile import __version__
from rbcompile.artifact.architectures import DECODER, ENCODER, lookup
from rbcompile.artifact.codegen import generate_source
from rbcompile.artifact.decoder import Decoder, DecoderShape
from rbcompile.artifact.executors import onnxruntime_reason
from rbcompile.artifact.heads import is_pretraining_head, labels, module_head
from rbcompile.artifact.ir import build_ir
from rbcompile.artifact.models import (
    checkpoint_sha256,
    load_hf_model,
    load_tokenizer,
    resolve_checkpoint,
)
from rbcompile.artifact.module import attach_weights, instantiate
from rbcompile.artifact.offramps import train_offramps
from rbcompile.artifact.placement import dtype_name, parse_device, parse_dtype
from rbcompile.artifact.plans import StoredPlan
from rbcompile.artifact.quality import load_head
from rbcompile.calibration_data import load_labelled, make_batches
from rbcompile.compiler.activations import activation_maxima
from rbcompile.compiler.calibrate import (
    Evaluator,
    build_plans,
    measure_importance,
    measure_width_importance,
)
from rbcompile.compiler.precision import LOW_LEVELS, measure_precisions
from rbcompile.compiler.trace import (
    cached_example_inputs,
    example_inputs,
    model_placement,
    trace,
    trace_cached,
)
from rbcompile.compiler.width import DEFAULT_LEVELS, build_variant
from rbcompile.errors import UserError
from rbcompile.passes import (
    CALIBRATED_PIPELINE,
    LAYOUT_PIPELINE,
    PIPELINE,
    PassContext,
    run_pipeline,
)
from rbcompile.passes.annotate_flops import REFERENCE_SEQ
from rbcompile.progress import say, step
from rbcompile.runtime.engine.model import Model


def graph_weights(gm, ir: dict) -> dict:
    """The tensors the IR's parameters name, read from the graph (after every pass)."""
    return {key: operator.attrgetter(key)(gm) for key in ir["parameters"].values()}


def build_module(ir: dict, weights: dict, title: str,
                 sharing: tuple[torch.nn.Module, ...] = ()) -> tuple[str, torch.nn.Module]:
    """(source, module with `weights` attached) for an IR: the one place code is generated.
    `sharing`: modules built earlier over the same weights, attached again with it (they then
    read views of the weights it stacks)."""
    ir["title"] = title
    source = generate_source(ir)
    module = instantiate(source, title)
    attach_weights([module, *sharing], weights)
    return source, module


def generate_module(gm, regions: list[dict], input_names, output_names, title: str):
    """(IR, source, module with the graph's weights) for a graph the passes have run on."""
    ir = build_ir(gm, regions, input_names, output_names)
    source, module = build_module(ir, graph_weights(gm, ir), title)
    return ir, source, module


def architecture_summary(model) -> dict:
    """The manifest's `architecture` section."""

    architecture = lookup(model.config)
    dims = architecture.dimensions(model.config)
    head = module_head(model, architecture.family)
    summary = {"model_type": architecture.model_type, "family": architecture.family,
               "class": type(model).__name__, "head": head, "layers": dims.layers,
               "hidden_size": dims.hidden, "vocab_size": dims.vocab}
    names = labels(model.config, head)
    return {**summary, "labels": names} if names else summary


def _state_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


CALIBRATION_DEFAULTS = {"decoder": {"samples": 8, "seq": 256, "batch": 4},
                        "encoder": {"samples": 256, "seq": 128, "batch": 32}}


def width_variants(eager, ir: dict, weights: dict, ctx, levels) -> list[dict]:
    """The IR of each width level's narrowed regions (levels that narrow nothing are left out)."""

    variants = []
    for ratio in levels:
        with step(f"tracing width level {ratio:g}"):
            variant = build_variant(eager, ir, weights, ctx, ratio)
        if variant:
            variants.append(variant)
    return variants


def check_width_levels(levels, floor: float) -> tuple[float, ...]:
    levels = tuple(sorted({float(level) for level in levels}, reverse=True))
    if not 0 < floor <= 1:
        raise UserError(f"width floor must be in (0, 1], got {floor}")
    bad = [level for level in levels if not floor <= level < 1]
    if bad:
        raise UserError(f"width levels must be in [{floor:g}, 1) (the floor is {floor:g}), got {bad}")
    return levels


@dataclass
class Calibration:
    """What calibration reads: its text as batches, the settings, the optional task head."""
    source: str
    family: str
    samples: int
    seq: int
    batches: object          # calibration_data.Batches
    head: object | None      # a task head (encoders), or None
    head_path: str | None
    levels: tuple[float, ...]
    task_head: str | None = None  # the model's own classifier head (heads.py), if any
    labelled: bool = False        # its loss reads the data's labels
    budgets: tuple[float, ...] | None = None  # the plans' budget grid (None: calibrate.BUDGET_GRID)

    @property
    def loss(self) -> str:
        if self.head is not None:
            return f"task head {self.head_path}"
        if self.task_head is not None and self.family == ENCODER:
            return (f"its {self.task_head} head: " + ("cross-entropy on the labels" if
                    self.labelled else "KL divergence to the full path's class distribution"))
        return "next-token" if self.family == DECODER else "1 - cosine to the full path"


def prepare_calibration(tokenizer, family: str, max_positions: int, source, samples=None,
                        seq=None, width_levels=DEFAULT_LEVELS, width_floor: float = 0.5,
                        head_path=None, task_head: str | None = None,
                        budgets=None, device="cpu") -> Calibration:
    """Check the calibration options and make the batches, before any tracing. A classifier
    (`task_head`) calibrates on its own logits: labelled JSONL gives a sequence classifier's
    cross-entropy, other data the KL divergence to the full path. `budgets`: the plans' budget
    grid (default calibrate.BUDGET_GRID); a shorter grid searches and verifies fewer plans.
    The batches, labels and head are put on `device` (the model's)."""

    defaults = CALIBRATION_DEFAULTS[family]
    samples, seq = samples or defaults["samples"], seq or defaults["seq"]
    if samples < 2 or seq < 2:
        raise UserError("--calib-samples and --calib-seq must be >= 2")
    levels = check_width_levels(width_levels, width_floor)
    if budgets is not None:
        budgets = tuple(sorted({float(b) for b in budgets}))
        if not budgets or not all(0 < b <= 1 for b in budgets):
            raise UserError(f"calibration budgets must be in (0, 1], got {list(budgets)}")
    seq = min(seq, max_positions)
    if head_path and task_head is not None and family == ENCODER:
        raise UserError(f"this model has its own {task_head} head: --calib-head is for "
                        "headless encoders")
    texts, labels = load_labelled(source)
    head = tuple(t.to(device) for t in load_head(head_path)) if head_path else None
    if head is not None and (family != ENCODER or labels is None):
        raise UserError("--calib-head needs an encoder and JSONL calibration data with an "
                        "integer \"label\" on every line")
    use_labels = labels is not None and (head is not None or task_head == "sequence-classification")
    batches = make_batches(tokenizer, texts, family, seq_len=seq, samples=samples,
                           batch_size=defaults["batch"],
                           labels=labels if use_labels else None).to(device)
    say(f"calibrating on {source}: {sum(len(b[0]) for b in batches.calibration)} samples x <= "
        f"{seq} tokens, {sum(len(b[0]) for b in batches.heldout)} held out")
    return Calibration(str(source), family, samples, seq, batches, head,
                       str(head_path) if head_path else None, levels, task_head, use_labels,
                       budgets)


def choose_plans(compiled, calibration: Calibration) -> tuple[dict, list[StoredPlan]]:
    """(importance of each region skipped / narrowed, verified plans), measured by running
    `compiled` on the calibration batches and the held-out ones."""

    batches, head = calibration.batches, calibration.head
    with step("measuring each region skipped and at each width level"):
        calib = Evaluator(compiled, batches.calibration, batches.calibration_labels, head)
        importance = measure_importance(compiled, calib)
    with step("choosing and verifying plans on held-out text"):
        heldout = Evaluator(compiled, batches.heldout, batches.heldout_labels, head)
        grid = {"grid": calibration.budgets} if calibration.budgets else {}
        plans = build_plans(compiled, importance, calib, heldout, **grid)
    return importance, plans


def build_decoder(model, architecture, dims, module, weights: dict, title: str,
                  kernels: bool = False, stack_projections: bool = False) -> Decoder:
    """The KV-cached decoder module (trace.CachedDecoder through the same passes and codegen),
    over `weights` (the tensors of the main `module` by key: one copy, permuted alike; the
    projections it stacks become views of the stacks in both modules)."""
    with step("tracing the KV-cached decoder (prefill and decode steps)"):
        traced = trace_cached(model, architecture, dims.max_positions)
    device, dtype = model_placement(model)
    seq = min(REFERENCE_SEQ, dims.max_positions)
    reference = cached_example_inputs(dims, seq, batch=1, seq=seq, dtype=dtype, device=device)
    ctx = PassContext(family=architecture.family, reference_inputs=reference,
                      input_names=traced.input_names, architecture=architecture, dims=dims,
                      kernels=kernels, fuse_projections=stack_projections)
    gm = traced.graph_module
    with step(f"running {len(PIPELINE + LAYOUT_PIPELINE)} passes on the decoder"):
        run_pipeline(gm, ctx)
        run_pipeline(gm, ctx, LAYOUT_PIPELINE)
    ir = build_ir(gm, ctx.regions, traced.input_names, traced.output_names, ctx.concatenated,
                  ctx.unpadded)
    own = graph_weights(gm, ir)
    source, decoder_module = build_module(ir, {**own, **weights}, f"{title} decoder", (module,))
    sizes = DecoderShape(dims.layers, dims.kv_heads, dims.head_dim, dims.max_positions)
    return Decoder(decoder_module, ir, source, sizes)


def choose_draft_plan(compiled, calibration: Calibration, prompts: int = 2,
                      prompt_tokens: int = 64, new_tokens: int = 32) -> dict:
    """The light plan `speculate="self"` drafts with, chosen by measured acceptance x cost:
    for each calibrated budget, greedy self-speculative generation on calibration text gives
    the tokens per full-path step (1 + accepted drafts) and the drafts per step; with a draft
    costing its decoder FLOP share and a verification step costing 1, the modelled speedup over
    plain decoding is tokens per step / (drafts per step x draft cost + 1). The best plan, if it
    beats 1.0, else budget None (self-drafting does not pay on this model)."""
    ids, mask = calibration.batches.calibration[0]
    rows = [row[mask_row.bool()][:prompt_tokens] for row, mask_row in zip(ids, mask)][:prompts]
    candidates = []
    for plan in compiled.plans or []:
        budget = plan.budget
        gates = compiled.decoder.gates_from(compiled.regions, compiled.gates_for_budget(budget))
        if budget == 0 or all(gates):
            continue
        drafted = accepted = steps = tokens = 0
        for row in rows:
            stats = compiled.generate(row[None], max_new_tokens=new_tokens, speculate="self",
                                      draft_budget=budget).stats
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
            steps, tokens = steps + stats.decode_steps, tokens + stats.step_tokens
        per_step = tokens / max(steps, 1)
        speedup = per_step / (drafted / max(steps, 1) * compiled.decoder.cost(gates) + 1)
        candidates.append({"budget": budget, "acceptance": accepted / max(drafted, 1),
                           "tokens_per_step": per_step, "modelled_speedup": speedup})
    best = max(candidates, key=lambda c: c["modelled_speedup"], default=None)
    chosen = best["budget"] if best and best["modelled_speedup"] > 1.0 else None
    return {"budget": chosen, "candidates": candidates}


def _load(model_or_path, calib, device, dtype):
    """(eval-mode model on `device` in `dtype`, checkpoint folder or None, manifest source,
    tokenizer when calibrating)."""
    if isinstance(model_or_path, torch.nn.Module):
        if calib is not None:
            raise UserError("calibrating needs a tokenizer: compile a checkpoint folder or a "
                            "bundled name, not a loaded module")

        model = model_or_path.eval()
        family = lookup(model.config).family
        module_head(model, family)  # refuses a head it does not know
        if family == ENCODER and is_pretraining_head(type(model).__name__):
            say(f"{type(model).__name__}'s pre-training head is not kept; compiling its encoder "
                "(hidden states)")
            model = model.base_model
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        return model, None, {"name": type(model).__name__, "path": None,
                             "sha256": _state_sha256(model)}, None
    checkpoint = resolve_checkpoint(model_or_path)
    # before minutes of work: calibration text needs the tokenizer
    tokenizer = load_tokenizer(checkpoint) if calib is not None else None
    with step(f"loading {model_or_path}"):
        model = load_hf_model(checkpoint, dtype).to(device or "cpu")
    return model, checkpoint, {"name": str(model_or_path), "path": str(checkpoint.resolve()),
                               "sha256": checkpoint_sha256(checkpoint)}, tokenizer


def compile_model(model_or_path, *, dump_pass: str | None = None, calib=None,
                  calib_samples: int | None = None, calib_seq: int | None = None,
                  width_levels=DEFAULT_LEVELS, width_floor: float = 0.5, calib_head=None,
                  kernels: bool | None = None, device=None, dtype=None, calib_budgets=None,
                  stack_projections: bool | None = None, precisions=None):
    """Compile a bundled model name, a checkpoint folder or a loaded transformers model;
    with `calib` (a text source), also calibrate importance and budget plans; with `kernels`,
    fuse norms, activations, rotaries and cache writes into rbcompile's kernels
    (passes/fuse_kernels.py; default: where the model is on CUDA, as the torch.compile backend
    does; on CPU they run their PyTorch references); `stack_projections`: the main graph and
    the KV-cached decoder compute q / k / v and gate / up as one matmul each
    (passes/fuse_projections.py; default: on CUDA, where it saves kernel launches; on CPU it
    measured no faster, `benchmarks/bench_stacking.py`).
    `calib_budgets`: the budgets plans are made for (default calibrate.BUDGET_GRID, 0.05 to
    0.5); the greedy search stops at the largest. `precisions`: the weight levels
    to measure (compiler/precision.py; "auto": int8 and int4 where onnxruntime runs the model;
    None: "auto" when calibrating, else none).

    `dtype` (fp32 / bf16 / fp16; default: the model's own, fp32 for checkpoints) is the
    precision the graph is traced and runs in; `device` where it is traced and placed (a loaded
    model is moved there, like `nn.Module.to`).

    One pass, in order: trace -> passes -> (calibration: head / channel importance, the
    permutation pass) -> layout passes (stacking) -> IR -> (width variants) -> codegen ->
    module -> (plans measured on it) -> Model (a CompiledModel that generates). The weights the module holds are the
    graph's after every pass."""
    device, dtype = parse_device(device), parse_dtype(dtype)
    model, checkpoint, source, tokenizer = _load(model_or_path, calib, device, dtype)
    model_device, model_dtype = model_placement(model)
    on_cuda = model_device.type == "cuda"
    kernels = on_cuda if kernels is None else kernels
    stack_projections = on_cuda if stack_projections is None else stack_projections
    architecture = lookup(model.config)
    dims = architecture.dimensions(model.config)
    arch = architecture_summary(model)
    arch["dtype"] = dtype_name(model_dtype)
    calibration = None
    if calib is not None:
        calibration = prepare_calibration(tokenizer, architecture.family,
                                          dims.max_positions, calib, calib_samples, calib_seq,
                                          width_levels, width_floor, calib_head,
                                          module_head(model, architecture.family),
                                          calib_budgets, model_device)
    with step(f"tracing {arch['class']} with torch.export (dynamic batch and sequence)"):
        traced = trace(model, architecture)
    arch["max_positions"] = traced.max_positions
    reference = example_inputs(architecture, dims.vocab, batch=1,
                               seq=min(REFERENCE_SEQ, traced.max_positions), device=model_device)
    reference[architecture.mask_input].fill_(1)
    ctx = PassContext(family=architecture.family, reference_inputs=reference,
                      input_names=traced.input_names, architecture=architecture, dims=dims,
                      dump_pass=dump_pass, kernels=kernels, fuse_projections=stack_projections)
    gm = traced.graph_module
    with step(f"running {len(PIPELINE)} passes"):
        run_pipeline(gm, ctx)
    if calibration is not None:
        _order_by_importance(model, gm, ctx, calibration)
    run_pipeline(gm, ctx, LAYOUT_PIPELINE)
    ir = build_ir(gm, ctx.regions, traced.input_names, traced.output_names, ctx.concatenated,
                  ctx.unpadded)
    weights = graph_weights(gm, ir)
    if calibration is not None:
        ir["variants"] = width_variants(model, ir, weights, ctx, calibration.levels)
    title = f"{source['name']} ({arch['class']}, rbcompile {__version__})"
    source_code, module = build_module(ir, weights, title)
    decoder = (build_decoder(model, architecture, dims, module, weights, title, kernels,
                             stack_projections)
               if architecture.family == DECODER else None)
    manifest = {"source": source, "architecture": arch, "passes": ctx.history,
                "cache_candidates": ctx.cache_candidates}
    artifact = dict(module=module, ir=ir, source=source_code, tokenizer_dir=checkpoint,
                    hf_config=model.config.to_dict(), decoder=decoder)
    compiled = Model(manifest=manifest, **artifact)
    if calibration is None:
        if precisions and decoder is not None and checkpoint is not None:  # the bundled text
            _measure_precisions(compiled, lambda: _bundled_text(compiled.tokenizer, dims),
                                precisions)
        return compiled
    return _calibrated(compiled, artifact, calibration, ctx, precisions)


PRECISION_SAMPLES, PRECISION_SEQ = 16, 256  # windows of the bundled text (a quarter held out)


def _measure_precisions(compiled, batches, precisions) -> None:
    """The manifest's `precisions`: each weight level measured on the held-out part of
    `batches()` (calibration.Batches), each calibrated plan at each level, and the int8 prefill
    (`prefill_precisions`), smoothed by the channel maxima of the calibration part's
    activations; "auto": int8 and int4 where the onnxruntime executor runs the model."""
    if precisions == "auto":
        precisions = LOW_LEVELS if onnxruntime_reason(compiled) is None else ()
    if precisions:
        text = batches()
        with step("recording the linears' input ranges on calibration text"):
            compiled.decoder.activation_max = activation_maxima(compiled, text.calibration)
            compiled.decoder.step_executor = None   # built again with them
        with step(f"measuring {', '.join(precisions)} weights on held-out text (onnxruntime)"):
            measured = measure_precisions(compiled, text.heldout, precisions, compiled.plans)
        compiled.manifest["precisions"] = [level.to_json() for level in measured.levels]
        if measured.prefills:
            compiled.manifest["prefill_precisions"] = [prefill.to_json()
                                                       for prefill in measured.prefills]
        if measured.plans:
            compiled.plans = measured.plans
            compiled.manifest["plans"] = [plan.to_json() for plan in measured.plans]


def _bundled_text(tokenizer, dims):
    """Batches of the bundled calibration text, calibration and held-out (precisions measured
    without --calib)."""
    texts, _ = load_labelled("default")
    return make_batches(tokenizer, texts, DECODER, seq_len=min(PRECISION_SEQ, dims.max_positions),
                        samples=PRECISION_SAMPLES, batch_size=2)


def _order_by_importance(model, gm, ctx: PassContext, calibration) -> None:
    """Measure head and channel importance on the calibration text, then permute the graph's
    weights so that a narrower width is a prefix of them."""

    batches = calibration.batches
    with step("measuring head and channel importance (gradients)"):
        ctx.width_importance = measure_width_importance(
            model, ctx.units, ctx.family, batches.calibration,
            batches.calibration_labels, calibration.head)
    run_pipeline(gm, ctx, CALIBRATED_PIPELINE)


def _calibrated(compiled, artifact: dict, calibration, ctx: PassContext, precisions=None):
    """`compiled` with its measured plans, its self-speculation draft plan and weight
    precisions (decoders) and its early-exit off-ramps (with a task head)."""
    importance, plans = choose_plans(compiled, calibration)
    manifest = {**compiled.manifest, "plans": [plan.to_json() for plan in plans], "calibration": {
        "source": calibration.source, "samples": calibration.samples, "seq": calibration.seq,
        "loss": calibration.loss, **importance, "width": ctx.width_importance,
        "permutations": ctx.permutations}}
    calibrated = Model(manifest=manifest, **artifact)
    if calibrated.decoder is not None:
        with step("choosing the self-speculation draft plan (acceptance x cost)"):
            calibrated.decoder.draft = choose_draft_plan(calibrated, calibration)
        say(f"  self-speculation drafts with budget {calibrated.decoder.draft['budget']}")
        _measure_precisions(calibrated, lambda: calibration.batches,
                            "auto" if precisions is None else precisions)
    if calibration.head is not None:
        batches = calibration.batches
        with step("training early-exit off-ramps"):
            calibrated.offramps = train_offramps(calibrated, batches.calibration,
                                                 batches.heldout, calibration.head)
        say(f"  off-ramps after layers {calibrated.offramps.layers}, exit threshold "
            f"{calibrated.offramps.threshold:.3f}")
    return calibrated
