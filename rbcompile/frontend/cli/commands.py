"""The commands that make, show, check and export artifacts: compile, inspect, curve,
train-policy, export-onnx, verify, models."""
from __future__ import annotations

import json

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).


def _cmd_compile(args) -> None:
    import logging
    from pathlib import Path

    import rbcompile
    from rbcompile.progress import say, step

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="  %(message)s")
    from rbcompile.artifact import manifest
    from rbcompile.artifact.atomic import check_replaceable
    check_replaceable(Path(args.output), manifest.owned_files, manifest.KIND)  # before the work
    model = rbcompile.compile(args.model, dump_pass=args.dump_pass, calib=args.calib,
                              calib_samples=args.calib_samples, calib_seq=args.calib_seq,
                              width_levels=args.width_levels, width_floor=args.width_floor,
                              calib_head=args.calib_head, calib_budgets=args.calib_budgets,
                              kernels=args.kernels,
                              device=args.device, dtype=args.dtype,
                              stack_projections=args.stack_projections,
                              precisions=args.precisions)
    if args.verbose:
        for entry in model.manifest["passes"]:
            say(f"  pass {entry['pass']}: {entry['summary']}")
    with step(f"writing artifact {args.output}"):
        out = model.save(args.output, weights=args.weights)
    packed = model.manifest.get("packed_weights")
    if packed:
        change = packed["max_abs_error"]
        print(f"linears stored {packed['level']} in {packed['file']}: largest weight change "
              f"{change:.3g}" + (" (the source values exactly)" if change == 0 else
                                 "; plans measured before packing are now unmeasured"))
    counts = {}
    for region in model.regions:
        counts[region["kind"]] = counts.get(region["kind"], 0) + 1
    print(f"wrote {out}: {len(model.regions)} regions "
          f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), {model.num_gates} gates")


def _region_rows(regions, setting):
    """Table rows; with a budget's (gates, widths), what each prunable region does."""
    rows = [("id", "kind", "unit", "gate", "module path", "FLOPs", "budget" if setting else "")]
    for r in regions:
        action = ""
        if setting and r["kind"] == "prunable":
            gates, widths = setting
            if not gates[r["gate"]]:
                action = "SKIP"
            elif widths and widths[r["gate"]] < 1:
                action = f"width {widths[r['gate']]:g}"
        rows.append((str(r["id"]), r["kind"], r.get("unit_kind", "-"), str(r.get("gate", "-")),
                     r["module_path"], f"{r['flops_share']:.1%}", action))
    return rows


def _cmd_inspect(args) -> None:
    from pathlib import Path

    from rbcompile.artifact.manifest import read as read_manifest
    from rbcompile.artifact.plans import plan_for_budget, skipped_share, stored_plans

    manifest = read_manifest(Path(args.artifact))
    regions = manifest["regions"]
    shares = {r["id"]: {float(w): v for w, v in r["width_shares"].items()}
              for r in regions if "width_shares" in r}
    setting = None
    if args.budget is not None:
        setting = plan_for_budget(regions, args.budget, stored_plans(manifest))
        gates, widths = setting
        saved = skipped_share(regions, gates, widths, shares)
        skipped = [r["id"] for r in regions if r["kind"] == "prunable" and not gates[r["gate"]]]
        narrowed = {r["id"]: widths[r["gate"]] for r in regions
                    if widths and r["kind"] == "prunable" and gates[r["gate"]] and widths[r["gate"]] < 1}
    if args.json:
        payload = {"source": manifest["source"], "architecture": manifest["architecture"],
                   "regions": regions, "plans": manifest.get("plans"),
                   "precisions": manifest.get("precisions"),
                   "prefill_precisions": manifest.get("prefill_precisions")}
        if setting:
            payload["budget"] = {"budget": args.budget, "skipped_regions": skipped,
                                 "narrowed_regions": narrowed, "skipped_prunable_flops": saved}
        print(json.dumps(payload, indent=1))
        return
    arch = manifest["architecture"]
    calibrated = "calibrated plans" if manifest.get("plans") else "fixed skip order (no --calib)"
    print(f"{manifest['source']['name']}: {arch['class']} ({arch['model_type']}, {arch['family']}), "
          f"{arch['layers']} layers, sha256 {manifest['source']['sha256'][:12]}, {calibrated}")
    if arch.get("labels"):
        print(f"  {arch['head']} head, {len(arch['labels'])} labels: "
              f"{', '.join(arch['labels'][:8])}{', ...' if len(arch['labels']) > 8 else ''}")
    if args.verbose:
        rows = _region_rows(regions, setting)
        widths_ = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths_)).rstrip())
    else:
        for kind in ("skeleton", "prunable", "cache"):
            chosen = [r for r in regions if r["kind"] == kind]
            print(f"  {len(chosen)} {kind} regions, {sum(r['flops_share'] for r in chosen):.1%} "
                  "of FLOPs" + (" (--verbose lists them)" if kind == "prunable" else ""))
    _print_plans(manifest)
    if setting:
        actions = [f"skips {r['name']}" for r in regions if r["id"] in skipped]
        actions += [f"{r['name']} at width {narrowed[r['id']]:g}" for r in regions
                    if r["id"] in narrowed]
        print(f"budget {args.budget}: skips {len(skipped)} regions, narrows {len(narrowed)} = "
              f"{saved:.1%} of prunable FLOPs" + (f" ({', '.join(actions)})" if actions else ""))
        if not manifest.get("plans") and saved > 0:
            print("  unmeasured: run and serve withhold it (the full path runs) unless "
                  "--allow-unmeasured-plans")


def _print_plans(manifest: dict) -> None:
    """Each calibrated plan's skipped share and measured quality loss (the guard reads it)."""
    from rbcompile.artifact.guard import DECODER, FORWARD
    from rbcompile.artifact.plans import stored_plans

    def loss(plan, key) -> str:
        value = plan.loss(key)
        return "unmeasured" if value is None else f"{value:.3f}"
    for plan in stored_plans(manifest) or []:
        decoder = f", decoder {loss(plan, DECODER)}" if "decoder" in manifest else ""
        decoder += "".join(f", {level} weights {value:.3f}"
                           for level, value in plan.precision_losses)
        print(f"  plan {plan.budget:g}: skips {plan.skipped_share or 0:.1%} of prunable "
              f"FLOPs, quality loss {loss(plan, FORWARD)}{decoder}")
    for level in manifest.get("precisions", []):   # measured weight precisions (--weights)
        heldout = level["heldout"]
        timed = [f"{speedup:.2f}x at {rows}" for rows, speedup in level.get("speedups", {}).items()]
        speed = f", decode step vs fp32: {', '.join(timed)} rows" if timed else ""
        print(f"  {level['level']} weights: perplexity {heldout['perplexity']:.2f}, top-1 "
              f"agreement {heldout['top1_agreement']:.1%}, quality loss "
              f"{level['decoder_quality_loss']:.3f}{speed}")
    for prefill in manifest.get("prefill_precisions", []):   # --prefill-weights
        losses = ", ".join(f"{level} {loss:.3f}" for level, loss in prefill["losses"].items())
        speed = (f", {prefill['speedup']:.2f}x fp32 on a {prefill['tokens']}-token prompt"
                 if prefill.get("speedup") else "")
        print(f"  {prefill['level']} prefill: quality loss decoding at {losses}{speed}")


CURVE_DEFAULTS = {"decoder": {"samples": 4, "seq": 512, "batch": 1},
                  "encoder": {"samples": 1000, "seq": 128, "batch": 16}}


def _cmd_export_onnx(args) -> None:
    import rbcompile
    from rbcompile.frontend.onnx_export import ATOL, RTOL, check_opset, export_onnx

    check_opset(args.opset)
    model = rbcompile.load(args.artifact)
    report = export_onnx(model, args.output, opset=args.opset, dynamic=not args.no_dynamic_axes,
                         budget=args.budget)
    then_nodes, else_nodes = report.branch_nodes
    print(f"wrote {report.path}: opset {report.opset}, {report.if_nodes} If nodes (a gate on "
          f"runs up to {then_nodes} nodes, off {else_nodes}), "
          + ("dynamic batch and sequence" if report.dynamic else "fixed input shape")
          + (f", widths of budget {args.budget:g} baked in" if report.widths else "")
          + f" ({report.seconds:.0f} s)")
    print(f"validated with onnxruntime (max abs diff vs PyTorch; allowed {ATOL:g} + "
          f"{RTOL:g} x largest |value|): "
          + ", ".join(f"{name} {diff:.2g}" for name, diff in report.max_diffs.items()))


def _cmd_curve(args) -> None:
    from pathlib import Path

    import rbcompile
    from rbcompile.artifact.quality import load_head
    from rbcompile.errors import UserError
    from rbcompile.frontend.curve import format_table, load_eval_data, plot, sweep
    from rbcompile.progress import step

    model = rbcompile.load(args.artifact)
    defaults = CURVE_DEFAULTS[model.family]
    settings = {k: getattr(args, k) or v for k, v in defaults.items()}
    if min(settings.values()) < 1 or args.rounds < 1:
        raise UserError("--samples, --seq, --batch and --rounds must be >= 1")
    if args.classifier and model.labels:
        raise UserError(f"this artifact has its own {model.task_head} head: --classifier is for "
                        "headless encoders")
    data = load_eval_data(model, args.data, **settings)
    if args.decode:
        return _decode_curve(args, model, data.batches)
    classifier = load_head(args.classifier) if args.classifier else None
    with step(f"measuring {len(model.plans or [])} plans and the static baseline on "
              f"{args.data or 'the bundled Tempest excerpt'}"):
        result = sweep(model, data, classifier=classifier, rounds=args.rounds)
    out = _curve_folder(args)
    result["settings"] = {**settings, "data": args.data or "bundled Tempest excerpt",
                          "rounds": args.rounds, "classifier": args.classifier}
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    name = Path(model.manifest["source"]["name"]).name  # a checkpoint folder: its own name
    plot(result, f"{name}: quality vs speedup ({settings['batch']} x {settings['seq']} tokens)",
         out / "curve.png")
    print(format_table(result))
    print(f"wrote {out / 'curve.json'} and {out / 'curve.png'}")


def _curve_folder(args):
    """`curve -o`, default ARTIFACT-curve, made if missing."""
    from pathlib import Path

    out = Path(args.output or f"{str(args.artifact).rstrip('/')}-curve")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _decode_curve(args, model, batches) -> None:
    """`curve --decode`: weight levels x skip plans, decode-step time and quality."""
    from pathlib import Path

    from rbcompile.errors import UserError
    from rbcompile.frontend import decode_curve
    from rbcompile.progress import step

    if model.family != "decoder":
        raise UserError("--decode is for decoders (the KV-cached decode step)")
    data = args.data or "the bundled Tempest excerpt"
    with step(f"measuring weight levels x skip plans on {data}, decode steps at batch 1"):
        points = decode_curve.frontier(model, batches, rounds=args.rounds)
    out = _curve_folder(args)
    (out / "decode-curve.json").write_text(json.dumps(decode_curve.as_json(points), indent=1))
    name = Path(model.manifest["source"]["name"]).name
    decode_curve.plot(points, f"{name}: precision and skipping, decode steps",
                      out / "decode-curve.png")
    print(decode_curve.format_table(points))
    print(f"wrote {out / 'decode-curve.json'} and {out / 'decode-curve.png'}")


def _cmd_train_policy(args) -> None:
    from rbcompile.runtime.control.train_policy import train_policy
    train_policy(args.artifact, args.workload, args.output, classifier=args.classifier,
                 slo_ms=args.slo_ms, steps=args.steps, max_batch=args.max_batch, seed=args.seed,
                 new_tokens=args.new_tokens, simulator=args.simulator)


def _cmd_verify(args) -> None:
    import time
    from pathlib import Path

    import rbcompile

    start = time.perf_counter()
    model = rbcompile.load(args.artifact)
    listed = model.manifest["files"]["sha256"]
    size = sum((Path(args.artifact) / name).stat().st_size for name in listed)
    print(f"{args.artifact}: ok ({len(listed)} files, {size / 1e6:.1f} MB, sha256 verified; "
          f"schema {model.manifest['schema_version']}; {len(model.regions)} regions, "
          f"{model.num_gates} gates, {len(model.plans or [])} plans) in "
          f"{time.perf_counter() - start:.1f} s")


def _cmd_models(args) -> None:
    from rbcompile.artifact.models import DEFAULT_MODEL, list_models
    for name, package, description in list_models():
        marker = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<14} {description}{marker}  [PyPI: {package}]")
