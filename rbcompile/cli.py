"""The `rbcompile` command. Exit codes: 0 ok, 2 bad input or usage, 1 internal error,
130 interrupted (SIGINT), 143 terminated (SIGTERM); an interrupted command leaves its output as
it was before."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from functools import partial

from .atomic import commits, note_stop
from .errors import check_unicode, first_line
from .serve_options import add_limit_options, limits_from

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so clean-up runs as for Ctrl-C."""


class _Stop:
    """SIGINT / SIGTERM handler of one command: the first signal raises (KeyboardInterrupt /
    Terminated) and is remembered, later ones are ignored so clean-up finishes. A library that
    turns the exception into its own error (transformers' lazy imports do) still ends the
    command with the signal's exit code; code that swallows it gets it back before an output is
    put in place (`atomic.note_stop`). The records libraries log while the command
    unwinds are dropped: a stopped command prints one line (torch's fake tensors log the
    TypeError a C++ binding may make of the KeyboardInterrupt, with its traceback). Once the
    command's output is in place (`atomic.commit_output`) or the command has ended, a signal
    changes nothing: "stopped" would be false, and the exit code stands."""

    def __init__(self):
        self.received = None
        self.ended = False
        self.commits = commits()
        self.logging_level = None  # what logging.disable was before a signal turned it off

    def __call__(self, signum, frame):
        if self.received is not None or self.ended or commits() != self.commits:
            return
        self.received = signum
        self.logging_level = logging.root.manager.disable
        logging.disable(logging.CRITICAL)
        stop = KeyboardInterrupt() if signum == signal.SIGINT else Terminated()
        note_stop(stop)  # raised again before an output is put in place, should it be swallowed
        raise stop

    def install(self) -> dict:
        """Make this the SIGINT / SIGTERM handler (main thread only); returns the ones before."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore_logging(self) -> None:
        """Logging as it was before the signal (if one came)."""
        if self.logging_level is not None:
            logging.disable(self.logging_level)

    def exit_code(self) -> int | None:
        return {signal.SIGINT: EXIT_SIGINT, signal.SIGTERM: EXIT_SIGTERM}.get(self.received)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block)
        print(f"rbcompile: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _budget(text: str) -> float:
    from .plans import check_budget
    try:
        return check_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _levels(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _guard_options(parser) -> None:
    from .guard import DEFAULT_MAX_QUALITY_LOSS
    parser.add_argument("--max-quality-loss", type=float, default=DEFAULT_MAX_QUALITY_LOSS,
                        help="the most quality a budget may cost: plans whose measured loss on "
                        "held-out text (decoders: share of next tokens changed, or perplexity "
                        f"rise) is over it are withheld (default {DEFAULT_MAX_QUALITY_LOSS:g})")
    parser.add_argument("--allow-unmeasured-plans", action="store_true",
                        help="let budgets run plans with no measured quality cost (an "
                        "uncalibrated artifact's fixed skip order); without it they run the "
                        "full path")


def _placement_options(parser, device_help: str, dtype_help: str) -> None:
    parser.add_argument("--device", help=device_help + ": cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help=dtype_help)


def _import_libraries() -> None:
    """Import torch and transformers with SIGINT / SIGTERM held: a signal inside their native
    initialisation can abort the process (or leave an interrupt pending past our handler);
    held, it is delivered right after, as a clean KeyboardInterrupt / Terminated."""
    from .atomic import signals_held

    with signals_held():
        import torch  # noqa: F401
        import transformers  # noqa: F401


def _build_parser() -> argparse.ArgumentParser:
    from .onnx_export import EXAMPLE_SHAPE

    parser = _Parser(prog="rbcompile", description="Compile Hugging Face transformers into "
                     "adaptive runtime modules (guarded light/full paths).")
    parser.add_argument("--version", action="version", version=f"rbcompile {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("compile", help="compile a bundled model name or a checkpoint folder")
    p.add_argument("model", help="bundled name (see `rbcompile models`) or checkpoint folder")
    p.add_argument("-o", "--output", required=True, help="artifact folder to write")
    p.add_argument("--calib", metavar="SOURCE",
                   help="calibrate on a text file, a JSONL of texts, or 'default' (bundled text)")
    p.add_argument("--calib-samples", type=int, default=None,
                   help="calibration samples (decoders: windows; encoders: paragraphs)")
    p.add_argument("--calib-seq", type=int, default=None, help="tokens per calibration sample")
    p.add_argument("--calib-head", metavar="HEAD",
                   help="headless encoders: a linear classifier head (safetensors: weight, "
                   "bias); with labelled JSONL calibration data, calibrate on its task loss (a "
                   "classifier checkpoint calibrates on its own head)")
    p.add_argument("--calib-budgets", type=_levels, default=None,
                   help="with --calib: the budgets to make and measure plans for, comma-"
                   "separated (default 0.05,0.1,...,0.5; a short grid searches less)")
    p.add_argument("--width-levels", type=_levels, default="0.75,0.5",
                   help="with --calib: narrower widths each region may run at (default 0.75,0.5)")
    p.add_argument("--width-floor", type=float, default=0.5,
                   help="fewest heads / channels a width level may keep (default 0.5)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse norms, activations, rotaries and cache writes into rbcompile's "
                   "kernels (Triton on CUDA; default: on with --device cuda, off on cpu, where "
                   "they run their PyTorch references)")
    p.add_argument("--stack-projections", action=argparse.BooleanOptionalAction, default=None,
                   help="compute q/k/v and gate/up as one matmul each "
                   "(default: on with --device cuda, off on cpu, where it measured no faster)")
    _placement_options(p, "trace and compile on this device (default cpu)",
                       "precision the graph is traced and runs in: fp32 (default), bf16, fp16")
    p.add_argument("--dump-pass", help="write the graph before/after this pass to ./rbcompile-dump")
    p.add_argument("-v", "--verbose", action="store_true", help="log every pass")

    p = sub.add_parser("inspect", help="show an artifact's regions")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print the manifest's regions as JSON")
    p.add_argument("--budget", type=_budget, help="also show which regions this budget skips")
    p.add_argument("--verbose", action="store_true", help="list every region (a table)")

    p = sub.add_parser("run", help="run an artifact on text")
    p.add_argument("artifact")
    p.add_argument("--text", required=True, action="append", help="input text (repeatable)")
    p.add_argument("--budget", type=_budget, help="fraction of prunable FLOPs to skip")
    p.add_argument("--complexity-threshold", type=float,
                   help="inputs scoring below it take the light path, the rest the full path")
    p.add_argument("--max-new-tokens", type=int, default=20, help="decoders: tokens to generate "
                   "(clipped, with a warning line, to the positions the prompt leaves)")
    p.add_argument("--speculate", choices=("off", "ngram", "self", "auto"), default="off",
                   help="decoders: lossless speculative decoding; ngram: drafts from the "
                   "prompt's own n-grams; self: from the light path; auto: per request")
    p.add_argument("--temperature", type=float, help="decoders: sample at this temperature "
                   "(default: greedy)")
    p.add_argument("--top-k", type=int, help="decoders: sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="decoders: sample from the smallest set of "
                   "tokens holding this probability")
    p.add_argument("--seed", type=int, help="decoders: seed of the sampler")
    p.add_argument("--consistency", choices=("off", "1", "3", "7", "auto"), default="off",
                   help="decoders: draw this many samples (with --temperature) sharing one "
                   "prefill and print the answer their majority vote gives; auto: as many as "
                   "the complexity router trained for the checkpoint picks")
    p.add_argument("--extract", default="first-line", help="with --consistency: how an answer is "
                   "read from a sample: first-line (default), last-number, choice (a letter "
                   "A-E), regex:PATTERN (its first group, else the match)")
    _placement_options(p, "run on this device (default cpu)",
                       "must be the dtype the artifact was compiled in (a check)")
    _guard_options(p)
    p.add_argument("--engine", choices=("torch", "onnxruntime"), default="torch",
                   help="torch (default): the generated PyTorch module; onnxruntime: its ONNX "
                   "export, fed the same gates as the graph input `gates`")
    p.add_argument("--onnx", metavar="FILE", help="with --engine onnxruntime: a file from "
                   "`rbcompile export-onnx` of this artifact (checked against it; export with "
                   "the --budget you run). Without it, the artifact is exported and validated "
                   "into a temporary folder for this run only (nothing cached)")

    p = sub.add_parser("export-onnx", help="export an artifact to ONNX: gates as a bool tensor "
                       "input, each prunable region an If node; validated with onnxruntime")
    p.add_argument("artifact")
    p.add_argument("-o", "--output", required=True, help=".onnx file to write (written to a "
                   "temporary file, validated, then renamed into place)")
    p.add_argument("--opset", type=int, default=20, help="ONNX opset, 18-23 (default 20)")
    p.add_argument("--no-dynamic-axes", action="store_true", help="fix the input shape to "
                   "batch %d x sequence %d (default: dynamic batch and sequence)" % EXAMPLE_SHAPE)
    p.add_argument("--budget", type=_budget, help="bake in the width levels of this budget's "
                   "plan (gates stay inputs; default: full width)")

    p = sub.add_parser("curve", help="quality vs measured speedup of every calibrated plan")
    p.add_argument("artifact")
    p.add_argument("--data", help="held-out text file or JSONL (default: bundled Tempest excerpt)")
    p.add_argument("--classifier", help="linear head (safetensors: weight, bias) over pooled "
                   "embeddings; with labelled JSONL data, accuracy is measured")
    p.add_argument("--samples", type=int, help="decoders: windows (default 4); encoders: texts "
                   "(default 1000)")
    p.add_argument("--seq", type=int, help="tokens per sample (default 512 / 128)")
    p.add_argument("--batch", type=int, help="batch size (default 1 / 16)")
    p.add_argument("--rounds", type=int, default=3, help="latency rounds (median)")
    p.add_argument("-o", "--output", help="folder for curve.json and curve.png "
                   "(default: ARTIFACT-curve)")

    p = sub.add_parser("train-policy", help="measure an artifact's latency / quality table and "
                       "train the PPO serving policy in a simulator built from it")
    p.add_argument("artifact", help="calibrated artifact folder")
    p.add_argument("--workload", required=True, help="JSONL of texts or a text file (one input "
                   "per paragraph), at least 200 inputs")
    p.add_argument("-o", "--output", required=True, help="folder for policy.safetensors, "
                   "policy.json and table.json")
    p.add_argument("--classifier", help="encoders: linear head (safetensors: weight, bias); "
                   "quality = its argmax agreement with the full path")
    p.add_argument("--slo-ms", type=float, default=100.0, help="latency objective (default 100)")
    p.add_argument("--steps", type=int, default=20000, help="PPO decisions (default 20000)")
    p.add_argument("--max-batch", type=int, default=16, help="largest batch served (default 16)")
    p.add_argument("--simulator", choices=("auto", "requests", "decode-step"), default="auto",
                   help="the runtime trained for: requests (AdaptiveServer, whole requests), "
                   "decode-step (rbcompile serve: continuous batching, --slo-ms per decode "
                   "step); auto (default): decode-step for decoders, requests for encoders")
    p.add_argument("--new-tokens", type=int, default=32, help="decode-step: tokens each "
                   "simulated request generates (default 32)")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("serve", help="serve an artifact over HTTP, OpenAI-compatible: "
                       "/v1/completions and /v1/chat/completions (decoders, continuously "
                       "batched), /v1/embeddings (encoders), /metrics")
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; "
                   "any other than loopback needs --api-key-env)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API "
                   "key every request but /health must send as 'Authorization: Bearer KEY'")
    add_limit_options(p)
    p.add_argument("--max-batch", type=int, default=16, help="decoders: most completions decoded "
                   "together, continuously batched (default 16; 1: one after another)")
    p.add_argument("--prefix-cache-mb", type=float, default=256, help="decoders: MiB of prompt-"
                   "prefix K/V blocks kept for reuse across requests (default 256; 0: off)")
    p.add_argument("--result-cache-mb", type=float, default=256, help="encoders: MiB of embeddings "
                   "kept for exact repeats (default 256; 0: off)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="decoders: prompts longer "
                   "than this are prefilled in chunks of it, one per decode step, so a long "
                   "prompt does not hold up the running streams (default 512; 0: never chunk)")
    p.add_argument("--policy", choices=("static", "pid", "ppo"), default="static",
                   help="decoders: who sets the budget of completions that bring none: static "
                   "(--budget), pid (holds the decode-step latency at --slo-ms), ppo "
                   "(--policy-file, from train-policy)")
    p.add_argument("--budget", type=_budget, default=0.0, help="static policy's budget "
                   "(default 0: the full path)")
    p.add_argument("--slo-ms", type=float, default=100.0, help="decode-step (inter-token) latency "
                   "objective of the pid policy (default 100)")
    p.add_argument("--policy-file", metavar="DIR", help="ppo: a folder written by train-policy")
    _guard_options(p)
    p.add_argument("--quality-check-every", type=int, default=16, metavar="N",
                   help="decoders: run the full path beside each light decode step of a plan "
                   "until 64 of its rows are compared, then one in N, and withhold a plan whose "
                   "live agreement is under the guard (default 16; 0: no checks)")
    _placement_options(p, "serve on this device (default cpu)",
                       "must be the dtype the artifact was compiled in (a check)")
    p.add_argument("--compile-plans", action="store_true", help="run the model and the decoder "
                   "through one inductor graph per plan (a plan's first use compiles it: tens "
                   "of seconds)")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA only: one CUDA graph per "
                   "plan and shape (decode steps: per batch and cache size)")
    p.add_argument("--ray", action="store_true", help="serve --replicas copies under Ray Serve, "
                   "its proxy on --host / --port, one controller for all (the 'ray' extra)")
    p.add_argument("--replicas", type=int, default=None, help="--ray: replicas, each loading the "
                   "artifact (default 2; the path must be readable on every node)")
    p.add_argument("--ray-address", metavar="ADDR", help="--ray: the cluster (auto, "
                   "ray://HEAD:10001; default: start Ray on this machine)")
    p.add_argument("--replica-cpus", type=float, default=None, help="--ray: CPUs each replica "
                   "reserves (default 1)")

    p = sub.add_parser("verify", help="check an artifact without running it: every file's "
                       "sha256, the manifest's schema, the generated code and the weights")
    p.add_argument("artifact")

    sub.add_parser("models", help="list the bundled model names")
    return parser


def _version() -> str:
    from . import __version__
    return __version__


def _cmd_compile(args) -> None:
    import logging
    from pathlib import Path

    import rbcompile
    from .progress import say, step

    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="  %(message)s")
    from .atomic import check_replaceable
    from . import manifest
    check_replaceable(Path(args.output), manifest.owned_files, manifest.KIND)  # before the work
    model = rbcompile.compile(args.model, dump_pass=args.dump_pass, calib=args.calib,
                              calib_samples=args.calib_samples, calib_seq=args.calib_seq,
                              width_levels=args.width_levels, width_floor=args.width_floor,
                              calib_head=args.calib_head, calib_budgets=args.calib_budgets,
                              kernels=args.kernels,
                              device=args.device, dtype=args.dtype,
                              stack_projections=args.stack_projections)
    if args.verbose:
        for entry in model.manifest["passes"]:
            say(f"  pass {entry['pass']}: {entry['summary']}")
    with step(f"writing artifact {args.output}"):
        out = model.save(args.output)
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

    from .manifest import read as read_manifest
    from .plans import plan_for_budget, skipped_share

    manifest = read_manifest(Path(args.artifact))
    regions = manifest["regions"]
    shares = {r["id"]: {float(w): v for w, v in r["width_shares"].items()}
              for r in regions if "width_shares" in r}
    setting = None
    if args.budget is not None:
        setting = plan_for_budget(regions, args.budget, manifest.get("plans"))
        gates, widths = setting
        saved = skipped_share(regions, gates, widths, shares)
        skipped = [r["id"] for r in regions if r["kind"] == "prunable" and not gates[r["gate"]]]
        narrowed = {r["id"]: widths[r["gate"]] for r in regions
                    if widths and r["kind"] == "prunable" and gates[r["gate"]] and widths[r["gate"]] < 1}
    if args.json:
        payload = {"source": manifest["source"], "architecture": manifest["architecture"],
                   "regions": regions, "plans": manifest.get("plans")}
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
    from .guard import DECODER, FORWARD, plan_loss

    def loss(plan, key) -> str:
        value = plan_loss(plan, key)
        return "unmeasured" if value is None else f"{value:.3f}"
    for plan in manifest.get("plans") or []:
        decoder = f", decoder {loss(plan, DECODER)}" if "decoder" in manifest else ""
        print(f"  plan {plan['budget']:g}: skips {plan.get('skipped_share', 0):.1%} of prunable "
              f"FLOPs, quality loss {loss(plan, FORWARD)}{decoder}")


def _cmd_run(args) -> None:
    from contextlib import nullcontext

    import rbcompile
    from .errors import UserError
    from .onnx_export import onnx_engine

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.onnx and args.engine != "onnxruntime":
        raise UserError("--onnx needs --engine onnxruntime")
    if any(not text.strip() for text in args.text):
        raise UserError("--text must not be empty")
    for text in args.text:
        check_unicode(text, "--text")
    model = rbcompile.load(args.artifact, device=args.device, dtype=args.dtype)
    _quality_guard(args, model)
    model.complexity_threshold = args.complexity_threshold
    baked = None if args.budget is None else model.guarded(args.budget).budget  # what runs
    with (nullcontext(model) if args.engine == "torch"
          else onnx_engine(model, args.onnx, baked)) as engine:
        _run_texts(model, engine, args)


def _run_texts(model, engine, args) -> None:
    """Print what `engine` (the CompiledModel or an OnnxRunner of it) makes of each text."""
    import torch

    from .errors import UserError
    from .quality import mean_pool

    tokenizer = model.tokenizer
    if model.family == "decoder" and engine is model:
        _generate_texts(model, args)
        return
    if model.family == "decoder":
        for text in args.text:  # the ONNX export has no KV cache: the prefix runs per token
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            prompt_len = ids.shape[1]
            for _ in range(_new_tokens(model, prompt_len, args)):
                out = engine(ids, budget=args.budget)
                next_id = out["logits"][0, -1].argmax().cpu()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
                if next_id.item() == tokenizer.eos_token_id:
                    break
            completion = tokenizer.decode(ids[0, prompt_len:], skip_special_tokens=True)
            print(f"{text!r} -> {completion!r}")
            print(_path_line(out) + (f", complexity {out.complexity[0]:.2f}" if out.complexity else ""))
        return
    lengths = [len(tokenizer(text)["input_ids"]) for text in args.text]
    if max(lengths) > model.max_positions:
        raise UserError(f"a text has {max(lengths)} tokens; the model has {model.max_positions} "
                        "positions")
    batch = tokenizer(args.text, return_tensors="pt", padding=True)
    out = engine(batch["input_ids"], batch["attention_mask"], budget=args.budget)
    if model.labels and "logits" in out:
        _print_labels(model, tokenizer, args.text, batch, out)
        return
    pooled = mean_pool(out["last_hidden_state"].float().cpu(), batch["attention_mask"])
    for i, text in enumerate(args.text):
        head = ", ".join(f"{v:+.3f}" for v in pooled[i, :6].tolist())
        print(f"{text!r}: mean-pooled embedding dim {pooled.shape[1]} [{head}, ...]")
    if len(args.text) > 1:
        sims = pooled @ pooled.T
        for i in range(len(args.text)):
            for j in range(i + 1, len(args.text)):
                print(f"  cosine(text {i + 1}, text {j + 1}) = {sims[i, j]:.4f}")
    print(_path_line(out))


def _path_line(out) -> str:
    """How a forward ran: its path, the FLOPs it skipped, and a budget the guard withheld."""
    withheld = f"; {out.plan.describe()}" if out.plan and out.plan.withheld else ""
    return f"  path {out.path}, skipped {out.skipped_flops:.1%} of prunable FLOPs{withheld}"


def _print_labels(model, tokenizer, texts, batch, out) -> None:
    """A classifier artifact: each text's predicted label and its probability (token
    classification: each real token's)."""
    probs = out["logits"].float().cpu().softmax(-1)
    best, index = probs.max(-1)
    for i, text in enumerate(texts):
        if probs.dim() == 2:
            print(f"{text!r}: {model.labels[index[i]]} (p={best[i]:.3f})")
            continue
        real = batch["attention_mask"][i].bool()
        tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][i][real].tolist())
        tagged = " ".join(f"{token}/{model.labels[label]} ({p:.3f})" for token, label, p in
                          zip(tokens, index[i][real].tolist(), best[i][real].tolist()))
        print(f"{text!r}: {tagged}")
    print(_path_line(out))


def _new_tokens(model, prompt_len: int, args) -> int:
    """--max-new-tokens clipped, with a warning line, to the positions the prompt leaves; a
    prompt that leaves none is refused."""
    from .errors import UserError

    room = model.max_positions - prompt_len
    if room < 1:
        raise UserError(f"the prompt has {prompt_len} tokens; the model has "
                        f"{model.max_positions} positions, so at most "
                        f"{model.max_positions - 1} prompt tokens can be continued")
    if args.max_new_tokens > room:
        print(f"rbcompile: warning: --max-new-tokens {args.max_new_tokens} clipped to "
              f"{room} (the model's {model.max_positions} positions minus the "
              f"{prompt_len}-token prompt)", file=sys.stderr)
    return min(args.max_new_tokens, room)


def _generate_texts(model, args) -> None:
    """Decoders on the torch engine: KV-cached generation, one text at a time."""
    from .guard import DECODER

    sampling = [args.temperature, args.top_k, args.top_p]
    if args.consistency != "off":
        return _vote_texts(model, args)
    for text in args.text:
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
        result = model.generate(
            ids, max_new_tokens=_new_tokens(model, ids.shape[1], args), budget=args.budget,
            speculate=args.speculate, do_sample=any(v is not None for v in sampling),
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        stats = result.stats
        completion = model.tokenizer.decode(result.tokens[0], skip_special_tokens=True)
        print(f"{text!r} -> {completion!r}")
        drafted = (f", {stats.accepted}/{stats.drafted} drafts accepted "
                   f"({stats.mean_accepted_length:.2f} tokens per step)" if stats.drafted else "")
        print(f"  {stats.new_tokens} tokens in {stats.seconds:.2f} s = "
              f"{stats.tokens_per_second:.1f} tokens/s (KV cache, speculate {args.speculate}"
              f"{drafted})")
        if args.budget:
            print(f"  {_plan_line(model, args.budget, DECODER)}")


def _vote_texts(model, args) -> None:
    """Decoders with --consistency k: k samples per text, their answers (--extract) voted."""
    from .consistency import VoteOptions
    from .errors import UserError

    k = args.consistency if args.consistency == "auto" else int(args.consistency)
    if k != 1 and args.temperature is None:
        raise UserError(f"--consistency {k} needs --temperature (greedy samples are all the same)")
    for text in args.text:
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
        result = model.generate(
            ids, max_new_tokens=_new_tokens(model, ids.shape[1], args), budget=args.budget,
            do_sample=args.temperature is not None,
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, speculate=args.speculate,
            consistency=k, vote=VoteOptions(extract=args.extract))
        stats = result.stats
        votes = ", ".join(f"{answer!r}: {count}" for answer, count in result.votes.items())
        print(f"{text!r} -> {result.answer!r}")
        tier = "" if stats.tier is None else \
            f"router: tier {stats.tier} (greedy + {stats.tier - 1} samples); "
        print(f"  {tier}votes {{{votes}}} from {stats.voted} of {stats.samples} answers"
              f"{' (stopped early)' if stats.stopped_early else ''}; {stats.prefills} prefill, "
              f"{stats.new_tokens} tokens in {stats.seconds:.2f} s")


CURVE_DEFAULTS = {"decoder": {"samples": 4, "seq": 512, "batch": 1},
                  "encoder": {"samples": 1000, "seq": 128, "batch": 16}}


def _cmd_export_onnx(args) -> None:
    import rbcompile
    from .onnx_export import ATOL, RTOL, check_opset, export_onnx

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
    from .curve import format_table, load_eval_data, plot, sweep
    from .quality import load_head
    from .errors import UserError
    from .progress import step

    model = rbcompile.load(args.artifact)
    defaults = CURVE_DEFAULTS[model.family]
    settings = {k: getattr(args, k) or v for k, v in defaults.items()}
    if min(settings.values()) < 1 or args.rounds < 1:
        raise UserError("--samples, --seq, --batch and --rounds must be >= 1")
    if args.classifier and model.labels:
        raise UserError(f"this artifact has its own {model.task_head} head: --classifier is for "
                        "headless encoders")
    data = load_eval_data(model, args.data, **settings)
    classifier = load_head(args.classifier) if args.classifier else None
    with step(f"measuring {len(model.plans or [])} plans and the static baseline on "
              f"{args.data or 'the bundled Tempest excerpt'}"):
        result = sweep(model, data, classifier=classifier, rounds=args.rounds)
    out = Path(args.output or f"{str(args.artifact).rstrip('/')}-curve")
    out.mkdir(parents=True, exist_ok=True)
    result["settings"] = {**settings, "data": args.data or "bundled Tempest excerpt",
                          "rounds": args.rounds, "classifier": args.classifier}
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    name = Path(model.manifest["source"]["name"]).name  # a checkpoint folder: its own name
    plot(result, f"{name}: quality vs speedup ({settings['batch']} x {settings['seq']} tokens)",
         out / "curve.png")
    print(format_table(result))
    print(f"wrote {out / 'curve.json'} and {out / 'curve.png'}")


def _cmd_train_policy(args) -> None:
    from .train_policy import train_policy
    train_policy(args.artifact, args.workload, args.output, classifier=args.classifier,
                 slo_ms=args.slo_ms, steps=args.steps, max_batch=args.max_batch, seed=args.seed,
                 new_tokens=args.new_tokens, simulator=args.simulator)


def _cmd_serve(args) -> None:
    import rbcompile
    from .errors import UserError

    api_key = _serve_api_key(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0-65535, got {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    for option in ("prefix_cache_mb", "result_cache_mb"):
        if not getattr(args, option) >= 0:
            raise UserError(f"--{option.replace('_', '-')} must be >= 0, got {getattr(args, option)}")
    if args.prefill_chunk < 0:
        raise UserError(f"--prefill-chunk must be >= 0 (0: never chunk), got {args.prefill_chunk}")
    if args.quality_check_every < 0:
        raise UserError(f"--quality-check-every must be >= 0, got {args.quality_check_every}")
    _guard_from(args)   # a bad --max-quality-loss before anything starts
    if args.ray:
        return _serve_ray(args, api_key)
    if args.replicas is not None or args.ray_address or args.replica_cpus is not None:
        raise UserError("--replicas, --ray-address and --replica-cpus go with --ray")
    try:
        from rbcompile.runtime import connections
        from rbcompile.runtime.http import create_app
        from rbcompile.runtime.quality_loop import QualityLoopConfig
    except ImportError as exc:
        raise UserError(f"rbcompile serve needs the 'serve' extra ({exc.name} is missing): "
                        "pip install 'rbcompile[serve]'") from None
    limits, connection_limits = limits_from(args)
    sock = connections.bind(args.host, args.port)   # a port in use: refused before loading
    model = rbcompile.load(args.artifact, device=args.device, dtype=args.dtype)
    _quality_guard(args, model)
    if args.compile_plans:
        model.compile_plans()
    if args.cuda_graphs:
        model.use_cuda_graphs()
    policy = _serve_policy(args, max(_serving_budgets(model), default=0.0))
    app = create_app(model, api_key=api_key, limits=limits, max_batch=args.max_batch,
                     prefix_cache_mb=args.prefix_cache_mb, prefill_chunk=args.prefill_chunk or None,
                     result_cache_mb=args.result_cache_mb, policy=policy, slo_s=args.slo_ms / 1000,
                     quality_loop=QualityLoopConfig(check_every=args.quality_check_every))
    print(f"quality guard: max quality loss {args.max_quality_loss:g}; {_guard_leaves(model)}",
          file=sys.stderr)
    print(f"serving {model.manifest['source']['name']} ({model.family}) on "
          f"http://{args.host}:{sock.getsockname()[1]}/v1", file=sys.stderr)
    _serve_until_signalled(partial(connections.serve, app, sock, connection_limits))


def _serve_ray(args, api_key: str | None) -> None:
    """`serve --ray`: replicas under Ray Serve, one controller (runtime/ray_serving.py)."""
    from .errors import UserError
    from .runtime.ray_serving import import_ray, serve_on_ray

    if args.device or args.dtype or args.compile_plans or args.cuda_graphs:
        raise UserError("--device, --dtype, --compile-plans and --cuda-graphs are not passed "
                        "to Ray replicas (they load the artifact on CPU as compiled); drop them "
                        "or --ray")
    args.replicas = 2 if args.replicas is None else args.replicas
    args.replica_cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
    if args.replicas < 1 or not args.replica_cpus > 0:
        raise UserError("--replicas must be >= 1 and --replica-cpus > 0")
    import_ray()  # the one-line error without the extra, before anything starts
    serve_on_ray(args, api_key)


def _serve_policy(args, max_budget: float):
    """The policy of --policy and its options (runtime/serve_policy.py)."""
    from .runtime.serve_policy import PolicyOptions, build_policy

    return build_policy(PolicyOptions(args.policy, args.budget, args.slo_ms, args.policy_file),
                        max_budget)


def _quality_guard(args, model) -> None:
    """`model.guard` from --max-quality-loss and --allow-unmeasured-plans; the guard speaks
    through the command's own lines, not Python warnings. One warning line when unmeasured
    plans may run; `serve` also says which lossy budgets its guard leaves."""
    import warnings

    from .compiled import QualityGuardWarning

    model.guard = _guard_from(args)
    warnings.filterwarnings("ignore", category=QualityGuardWarning)
    lossy, unmeasured = _lossy_plans(model), _unmeasured_plans(model)
    if args.allow_unmeasured_plans and (unmeasured or not lossy):
        what = f"{unmeasured} of its plans" if lossy else "every lossy budget (uncalibrated)"
        print(f"rbcompile: warning: --allow-unmeasured-plans: {what} may run with no measured "
              "quality cost", file=sys.stderr)


def _lossy_plans(model) -> list[dict]:
    return [plan for plan in model.plans or [] if plan["budget"] > 0]


def _unmeasured_plans(model) -> int:
    """How many of the stored lossy plans have no measured loss where the model serves."""
    from .guard import DECODER, FORWARD, plan_loss

    path = DECODER if model.decoder is not None else FORWARD
    return sum(plan_loss(plan, path) is None for plan in _lossy_plans(model))


def _guard_from(args):
    """The QualityGuard of --max-quality-loss and --allow-unmeasured-plans."""
    from .errors import UserError
    from .guard import QualityGuard

    if not args.max_quality_loss >= 0:
        raise UserError(f"--max-quality-loss must be >= 0, got {args.max_quality_loss}")
    return QualityGuard(args.max_quality_loss, args.allow_unmeasured_plans)


def _guard_leaves(model) -> str:
    """What a serving guard leaves the controller: the budgets it allows that skip work."""
    lossy, unmeasured = _lossy_plans(model), _unmeasured_plans(model)
    allowed = _serving_budgets(model)
    if allowed and not lossy:
        return "any lossy budget (unmeasured)"
    if allowed:
        return f"lossy budgets {', '.join(f'{b:g}' for b in allowed)}"
    if not lossy:
        return "no lossy plan (uncalibrated: none is measured): the full path only"
    measured = len(lossy) - unmeasured
    return (f"no lossy plan ({measured} measured: over it or skipping nothing in the decoder, "
            f"{unmeasured} unmeasured): the full path only")


def _serving_budgets(model) -> list[float]:
    """The budgets > 0 the guard lets a controller set that skip some work where it runs (a
    decoder's plan that only narrows runs the whole KV-cached decoder)."""
    from .guard import DECODER, FORWARD, lossy_budgets

    if model.decoder is None:
        return lossy_budgets(model.plans, model.guard, FORWARD)
    return [budget for budget in lossy_budgets(model.plans, model.guard, DECODER)
            if not all(model.decoder_gates(min(budget, 1.0)) or [True])]


def _plan_line(model, budget, path: str) -> str:
    """What `budget` ran under the guard, with the flag that would change it."""
    from .guard import UNMEASURED

    plan = model.guarded(budget, path)
    hint = ""
    if plan.withheld == UNMEASURED:
        hint = " (compile with --calib to measure plans, or --allow-unmeasured-plans)"
    elif plan.withheld is not None:
        hint = f" (--max-quality-loss {model.guard.max_quality_loss:g}; raise it to allow more)"
    return plan.describe() + hint


def _serve_until_signalled(serve) -> None:
    """Run `serve` (uvicorn, which drains on SIGINT / SIGTERM: no new connections, open
    requests finished, then the app's shutdown) and end normally after a drain: uvicorn
    replays the signal it caught to the handlers it found, here ones that only note it."""
    noted = []
    held = ({signum: signal.signal(signum, lambda number, frame: noted.append(number))
             for signum in (signal.SIGINT, signal.SIGTERM)}
            if threading.current_thread() is threading.main_thread() else {})
    try:
        serve()
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


def _serve_api_key(args) -> str | None:
    """The API key named by --api-key-env; refused when that variable is unset, or missing
    when binding a non-loopback address."""
    import ipaddress

    from .errors import UserError

    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise UserError(f"--api-key-env {args.api_key_env}: that environment variable is "
                            "not set or empty")
        return key
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"--host {args.host} is not a loopback address: serving it needs an API "
                        "key (--api-key-env VAR, with the key in $VAR)")
    return None


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
    from .models import DEFAULT_MODEL, list_models
    for name, package, description in list_models():
        marker = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<14} {description}{marker}  [PyPI: {package}]")


COMMANDS = {"compile": _cmd_compile, "inspect": _cmd_inspect, "run": _cmd_run,
            "export-onnx": _cmd_export_onnx, "verify": _cmd_verify,
            "curve": _cmd_curve, "train-policy": _cmd_train_policy, "serve": _cmd_serve,
            "models": _cmd_models}


def main(argv=None) -> int:
    """Run one command in this process and return its exit code; its SIGINT / SIGTERM handler
    is in place while it runs, and the earlier ones are put back (unless a signal came: then
    `stop` stays, as a library may re-trip SIGINT while Python exits); logging is as it was."""
    stop = _Stop()
    previous = stop.install()
    try:
        return _run(argv, stop)
    finally:
        stop.restore_logging()
        for signum, handler in previous.items() if stop.received is None else ():
            signal.signal(signum, handler)


def _run(argv, stop: _Stop) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .errors import UserError
    try:
        try:
            args = _build_parser().parse_args(argv)
        except SystemExit as exc:  # usage errors (exit 2), --help and --version (exit 0)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if args.command != "models" and threading.current_thread() is threading.main_thread():
            _import_libraries()
        COMMANDS[args.command](args)
    except (KeyboardInterrupt, Terminated, Exception) as exc:
        stopped = stop.exit_code() or (EXIT_SIGINT if isinstance(exc, KeyboardInterrupt) else None)
        if stopped is not None:
            return _stopped(stopped)
        if isinstance(exc, UserError):
            print(f"rbcompile: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("RBCOMPILE_DEBUG"):  # an rbcompile bug: one line, or the traceback
            raise
        print(f"rbcompile: internal error: {type(exc).__name__}: {first_line(exc)} "
              "(set RBCOMPILE_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        stop.ended = True
        note_stop(None)
    return _stopped(stop.exit_code()) if stop.received is not None else EXIT_OK  # swallowed


def _stopped(code: int) -> int:
    print(f"rbcompile: {'interrupted' if code == EXIT_SIGINT else 'terminated'}", file=sys.stderr)
    return code


def entry() -> None:
    """The `rbcompile` command (console script, `python -m rbcompile`, `python -m rbcompile.cli`).

    Once the command has ended, SIGINT / SIGTERM are ignored until the process is gone: CPython
    puts the default handlers back in place of Python ones while it finalises, and a SIGTERM
    then (under the default handler, a kill: -15, not 0 or 143) would misreport a command whose
    output is in place. After SIGINT / SIGTERM the command has already cleaned up; it then
    leaves without interpreter finalisation, because CPython re-kills itself with SIGINT there
    (exit -2, not 130) when a library evaluated code that saw the KeyboardInterrupt."""
    stop = _Stop()
    stop.install()
    code = _run(None, stop)
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIG_IGN is kept through finalisation
        signal.signal(signum, signal.SIG_IGN)
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
