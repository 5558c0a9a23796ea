"""The `rbcompile` command line: its parser, one function per command's options."""
from __future__ import annotations

import argparse
import sys

from rbcompile.artifact.manifest import PRECISION_LEVELS  # stdlib only: no torch here
from rbcompile.frontend.cli.serve_options import add_limit_options

# Deferred on purpose: the commands import the rest of rbcompile (and torch) when they run,
# so the CLI starts, and handles Ctrl-C, before torch loads (see __init__._import_heavy).

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block)
        print(f"rbcompile: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _budget(text: str) -> float:
    from rbcompile.artifact.plans import check_budget
    try:
        return check_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _levels(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _precisions(text: str) -> tuple[str, ...] | str:
    if text.strip().lower() == "auto":
        return "auto"
    levels = () if text.strip().lower() in ("", "none") else tuple(
        dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [level for level in levels if level not in PRECISION_LEVELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"precisions are among {','.join(PRECISION_LEVELS)} (or "
                                         f"none), got {', '.join(unknown)}")
    return levels


def _guard_options(parser) -> None:
    from rbcompile.artifact.guard import DEFAULT_MAX_QUALITY_LOSS
    parser.add_argument("--max-quality-loss", type=float, default=DEFAULT_MAX_QUALITY_LOSS,
                        help="the most quality a budget may cost: plans whose measured loss on "
                        "held-out text (decoders: share of next tokens changed, or perplexity "
                        f"rise) is over it are withheld (default {DEFAULT_MAX_QUALITY_LOSS:g})")
    parser.add_argument("--allow-unmeasured-plans", action="store_true",
                        help="let budgets run plans with no measured quality cost (an "
                        "uncalibrated artifact's fixed skip order); without it they run the "
                        "full path")


def _executor_options(parser) -> None:
    parser.add_argument("--executor", choices=("auto", "torch", "onnxruntime"), default="auto",
                        help="decoders: what runs the KV-cached decode steps: onnxruntime (one "
                        "graph per plan, no per-op overhead), torch (the generated module op "
                        "by op, the reference), auto (default: onnxruntime where it runs the "
                        "model, a Llama-family fp32 decoder on the CPU)")
    parser.add_argument("--weights", choices=("fp32", *PRECISION_LEVELS, "auto"),
                        default="fp32",
                        help="decoders, onnxruntime executor: weight precision (int8 and int4 "
                        "compute with int8 activations, int4 keeps the vocabulary head int8; "
                        "int4-fp32: int4 blocks, fp32 activations and head, exact on a GGUF "
                        "Q4 source); allowed where its quality loss measured at compile is "
                        "within --max-quality-loss. auto: the level whose decode step measured "
                        "fastest at compile among those allowed (fp32 if none)")
    parser.add_argument("--prefill-weights", choices=("fp32", "int8", "auto"), default="fp32",
                        help="decoders, onnxruntime executor: the precision prompts are "
                        "prefilled at (int8: activations quantized per token; decoding stays "
                        "at --weights); allowed where its loss measured at compile with "
                        "--weights decoding is within --max-quality-loss. auto: int8 where "
                        "allowed and measured faster than fp32")


    parser.add_argument("--tier-weights", type=_tier_weights, metavar="K=LEVEL,...|auto",
                        help="decoders, with consistency votes: the weight level a vote of K "
                        "samples decodes at (1=int4,3=fp32,7=int8; a K not given: --weights), "
                        "or auto: per K, the level measured fastest at K rows within "
                        "--max-quality-loss")


def _tier_weights(text: str) -> dict[int, str] | str:
    from rbcompile.errors import UserError
    from rbcompile.runtime.engine.consistency import parse_tier_weights
    try:
        return parse_tier_weights(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _placement_options(parser, device_help: str, dtype_help: str) -> None:
    parser.add_argument("--device", help=device_help + ": cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help=dtype_help)


def _version() -> str:
    from rbcompile import __version__
    return __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rbcompile", description="Compile Hugging Face transformers into "
                     "adaptive runtime modules (guarded light/full paths).")
    parser.add_argument("--version", action="version", version=f"rbcompile {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_compile(sub)
    _add_inspect(sub)
    _add_run(sub)
    _add_export_onnx(sub)
    _add_curve(sub)
    _add_train_policy(sub)
    _add_serve(sub)
    _add_verify(sub)
    return parser


def _add_compile(sub) -> None:
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
    p.add_argument("--precisions", type=_precisions, default="auto", metavar="LEVELS",
                   help="decoders: weight precisions to measure on held-out text for `run` / "
                   f"`serve --weights` (comma-separated among {','.join(PRECISION_LEVELS)}, or "
                   "none; default auto: all of them where the onnxruntime executor runs the "
                   "model)")
    p.add_argument("--weights", choices=("fp32", "int8", "int4"), default="fp32",
                   help="store the linears at this precision, the smallest artifact (int4 keeps "
                   "the vocabulary head int8); the full path runs their values. A GGUF source's "
                   "own blocks are reproduced exactly; the largest change is printed")
    p.add_argument("--dump-pass", help="write the graph before/after this pass to ./rbcompile-dump")
    p.add_argument("-v", "--verbose", action="store_true", help="log every pass")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show an artifact's regions")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true", help="print the manifest's regions as JSON")
    p.add_argument("--budget", type=_budget, help="also show which regions this budget skips")
    p.add_argument("--verbose", action="store_true", help="list every region (a table)")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run an artifact on text")
    p.add_argument("artifact")
    p.add_argument("--text", required=True, action="append", help="input text (repeatable)")
    p.add_argument("--budget", type=_budget, help="fraction of prunable FLOPs to skip")
    p.add_argument("--complexity-threshold", type=float,
                   help="inputs scoring below it take the light path, the rest the full path")
    p.add_argument("--max-new-tokens", type=int, default=20, help="decoders: tokens to generate "
                   "(clipped, with a warning line, to the positions the prompt leaves)")
    p.add_argument("--speculate", choices=("off", "ngram", "self", "quant", "auto"), default="off",
                   help="decoders: lossless speculative decoding; ngram: drafts from the "
                   "prompt's own n-grams; self: from the light path; quant: from a lower weight "
                   "level (onnxruntime executor); auto: per request")
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
    _executor_options(p)
    p.add_argument("--engine", choices=("torch", "onnxruntime"), default="torch",
                   help="torch (default): the generated PyTorch module; onnxruntime: its ONNX "
                   "export, fed the same gates as the graph input `gates`")
    p.add_argument("--onnx", metavar="FILE", help="with --engine onnxruntime: a file from "
                   "`rbcompile export-onnx` of this artifact (checked against it; export with "
                   "the --budget you run). Without it, the artifact is exported and validated "
                   "into a temporary folder for this run only (nothing cached)")


def _add_export_onnx(sub) -> None:
    from rbcompile.frontend.onnx_export import EXAMPLE_SHAPE

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


def _add_curve(sub) -> None:
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
    p.add_argument("--decode", action="store_true", help="decoders: the decode step's frontier "
                   "instead, weight precisions (fp32, int8, int4) x skip plans, timed per step "
                   "(decode-curve.json, decode-curve.png)")
    p.add_argument("-o", "--output", help="folder for curve.json and curve.png "
                   "(default: ARTIFACT-curve)")


def _add_train_policy(sub) -> None:
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


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve an artifact over HTTP, OpenAI-compatible: "
                       "/v1/completions and /v1/chat/completions (decoders, continuously "
                       "batched), /v1/embeddings (encoders), /metrics")
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; "
                   "any other than loopback needs --api-key-env)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API "
                   "key every request but /health must send as 'Authorization: Bearer KEY'")
    p.add_argument("--api-key", metavar="KEY", help="the API key itself (as `vllm serve` takes "
                   "it; visible in the process list: --api-key-env keeps it out)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model id clients send and "
                   "/v1/models lists (default: the artifact folder's name; the source "
                   "checkpoint's name is accepted too)")
    p.add_argument("--public-metrics", action="store_true", help="leave /metrics without the "
                   "API key (for a Prometheus scraper)")
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
    _executor_options(p)
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


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check an artifact without running it: every file's "
                       "sha256, the manifest's schema, the generated code and the weights")
    p.add_argument("artifact")

    sub.add_parser("models", help="list the bundled model names")
