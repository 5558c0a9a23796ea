"""Engines side by side: eager vs inductor vs onnxruntime (full model) vs rbcompile with inductor
regions vs rbcompile in onnxruntime, at the full path and at budgets, on real text.

Every contender runs the same batch, interleaved (one call each per round, ABBA order), after its
warm-up (compilation, session creation); onnxruntime's threads do not spin between runs (they
would steal the cores of the torch contender that follows). Printed: median latency and its ratio to eager, inductor and
onnxruntime running the full model. Each budget's quality is measured on held-out text through
the torch engine (the onnxruntime engine matches it within 1e-4, checked at export): decoders
perplexity and top-1 agreement with the full path, encoders cosine of mean-pooled embeddings to
the full path (or, with --classifier and --labelled, accuracy of that head).
Writes benchmarks/results/bench_engines_<models>.json.

    python benchmarks/bench_engines.py [--models build/minilm-mr build/smollm2-calib]
        [--budgets 0.25 0.5] [--rounds 9] [--threads 2]

A model is an artifact folder or a bundled name (compiled here, without calibration).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (interleaved_medians, load_with_eager, pin_threads, print_table,  # noqa: E402
                    text_windows, write_json)

from rbcompile.artifact import quality  # noqa: E402
from rbcompile.artifact.ort_threads import session_options  # noqa: E402
from rbcompile.frontend.onnx_export import OnnxRunner, export_onnx  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

SHAPES = {"encoder": (8, 64), "decoder": (2, 128)}   # batch x tokens timed per family
QUALITY_BATCHES = 4                                    # held-out batches of that shape


class _Plain(torch.nn.Module):
    """The transformers model as (input_ids, attention_mask) -> first output, for export."""

    def __init__(self, model, family: str):
        super().__init__()
        self.model, self.extra = model, ({"use_cache": False} if family == "decoder" else {})

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **self.extra)[0]


def plain_onnx_session(eager, family: str, example, folder: Path, threads: int):
    """onnxruntime running the original model (torch.onnx.export, dynamic batch / sequence)."""
    import onnxruntime

    axes = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
    path = folder / "plain.onnx"
    program = torch.onnx.export(_Plain(eager, family).eval(), example, dynamo=True,
                                input_names=["input_ids", "attention_mask"],
                                dynamic_shapes={"input_ids": axes, "attention_mask": axes},
                                verbose=False)
    program.save(str(path))
    return onnxruntime.InferenceSession(str(path), session_options(threads, spinning=False),
                                        providers=["CPUExecutionProvider"])


def budget_quality(compiled, budgets, windows, classifier=None) -> dict[float, dict]:
    """Quality of each budget on held-out batches, against the full path (see module docstring)."""
    parts = {b: [] for b in budgets}
    for input_ids, mask, labels in windows:
        full = compiled(input_ids, mask)
        reference = quality.reference(compiled.family, full, mask)
        for b in budgets:
            out = full if b == 0 else compiled(input_ids, mask, budget=b)
            parts[b].append(quality.measure(compiled.family, out, input_ids, mask, reference,
                                            labels, classifier))
    return {b: quality.summarise(compiled.family, p, task=classifier is not None)
            for b, p in parts.items()}


def _held_out(compiled, shape, labelled, classifier):
    batch, seq = shape
    if labelled and classifier is not None:
        from rbcompile.calibration_data import load_labelled
        texts, labels = load_labelled(labelled)
        rows = []
        for i in range(0, min(len(texts), 64 * batch), batch):
            enc = compiled.tokenizer(texts[i:i + batch], return_tensors="pt", padding=True,
                                     truncation=True, max_length=seq)
            rows.append((enc["input_ids"], enc["attention_mask"], torch.tensor(labels[i:i + batch])))
        return rows
    ids, mask = text_windows(compiled.tokenizer, QUALITY_BATCHES * batch, seq,
                             file="tempest-excerpt.txt")
    return [(ids[i:i + batch], mask[i:i + batch], None) for i in range(0, len(ids), batch)]


def bench_model(name: str, budgets: list[float], rounds: int, threads: int, classifier,
                labelled) -> list[dict]:
    with step(f"loading {name}"):
        compiled, eager = load_with_eager(name)
        inductor_regions, _ = load_with_eager(name)
    family = compiled.family
    shape = SHAPES[family]
    input_ids, mask = text_windows(compiled.tokenizer, *shape)
    extra = {"use_cache": False} if family == "decoder" else {}
    head = quality.load_head(classifier) if classifier else None
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        folder = Path(tmp)
        with step("exporting the original model to ONNX"):
            plain = plain_onnx_session(eager, family, (input_ids, mask), folder, threads)
        feeds = {"input_ids": input_ids.numpy(), "attention_mask": mask.numpy()}
        inductor = torch.compile(eager)
        inductor_regions.compile_regions()
        runners = {}
        for b in [0.0, *budgets]:
            with step(f"exporting rbcompile at budget {b:g} to ONNX"):
                report = export_onnx(compiled, folder / f"rb-{b:g}.onnx",
                                     budget=b or None, validate=False)
            runners[b] = OnnxRunner(compiled, report.path, threads)
        contenders = {
            "eager": lambda: eager(input_ids=input_ids, attention_mask=mask, **extra),
            "inductor": lambda: inductor(input_ids=input_ids, attention_mask=mask, **extra),
            "onnxruntime": lambda: plain.run(None, feeds),
        }
        for b in [0.0, *budgets]:
            label = "full" if b == 0 else f"budget {b:g}"
            contenders[f"rbcompile inductor {label}"] = \
                lambda b=b: inductor_regions(input_ids, mask, budget=b)
            contenders[f"rbcompile onnxruntime {label}"] = lambda b=b: runners[b](input_ids, mask, budget=b)
        with step("warming up (inductor compiles here)"):
            for fn in contenders.values():
                fn()
        say(f"== {name}: {len(contenders)} contenders, batch {shape[0]} x {shape[1]} tokens, "
            f"{rounds} interleaved rounds")
        timings = interleaved_medians(contenders, rounds)
        reference = eager(input_ids=input_ids, attention_mask=mask, **extra)[0]
        parity = {"inductor": inductor(input_ids=input_ids, attention_mask=mask, **extra)[0],
                  "onnxruntime": torch.from_numpy(plain.run(None, feeds)[0]),
                  "rbcompile inductor full": inductor_regions(input_ids, mask)[compiled.output_names[0]],
                  "rbcompile onnxruntime full": runners[0.0](input_ids, mask)[compiled.output_names[0]]}
        with step("measuring each budget's quality on held-out text"):
            scores = budget_quality(compiled, [0.0, *budgets],
                                    _held_out(compiled, shape, labelled, classifier), head)
    peers = {peer: timings[peer]["median_ms"] for peer in ("eager", "inductor", "onnxruntime")}
    rows = []
    for contender, t in timings.items():
        budget = 0.0 if not contender.startswith("rbcompile") or contender.endswith("full") \
            else float(contender.rsplit(" ", 1)[1])
        row = {"model": name, "batch": shape[0], "seq": shape[1], "contender": contender,
               "budget": budget, **t,
               **{f"vs_{peer}": ms / t["median_ms"] for peer, ms in peers.items()}}
        if contender in parity:
            row["max_abs_diff_vs_eager"] = (parity[contender] - reference).abs().max().item()
        if contender.startswith("rbcompile"):
            row["quality"] = scores[budget]
            row["skipped_prunable_flops"] = compiled.skipped_share(*compiled.plan_for_budget(budget))
        rows.append(row)
    return rows


def _quality_text(row) -> str:
    q = row.get("quality")
    if not q:
        return "-"
    if "perplexity" in q:
        return f"ppl {q['perplexity']:.2f}, top-1 {q['top1_agreement']:.1%}"
    return f"accuracy {q['accuracy']:.1%}" if "accuracy" in q else f"cosine {q['cosine']:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["minilm-l6", "smollm2-135m"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.5])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--classifier", help="encoder task head (safetensors) for accuracy")
    parser.add_argument("--labelled", help="labelled JSONL for --classifier")
    args = parser.parse_args()
    if any(not 0 < b <= 1 for b in args.budgets) or args.rounds < 1:
        parser.error("budgets must be in (0, 1] and --rounds >= 1")
    pin_threads(args.threads)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.budgets, args.rounds, args.threads, args.classifier,
                            args.labelled if "minilm" in name else None)
    table = [{**r, "median": f"{r['median_ms']:.1f}",
              **{k: f"{r[k]:.2f}x" for k in ("vs_eager", "vs_inductor", "vs_onnxruntime")},
              "skipped": f"{r['skipped_prunable_flops']:.0%}" if "skipped_prunable_flops" in r else "-",
              "diff": f"{r['max_abs_diff_vs_eager']:.1e}" if "max_abs_diff_vs_eager" in r else "-",
              "quality_text": _quality_text(r)} for r in rows]
    print("\nEngines on real text (Emma), interleaved rounds, median ms; ratios > 1x are faster "
          "than that peer running the full model.\nQuality of a budget: held-out text (Tempest) "
          "or --labelled data, against the full path.\n")
    print_table(table, [("model", "model"), ("contender", "contender"), ("median", "median ms"),
                        ("vs_eager", "vs eager"), ("vs_inductor", "vs inductor"),
                        ("vs_onnxruntime", "vs onnxruntime"), ("skipped", "skipped FLOPs"),
                        ("diff", "max diff vs eager"), ("quality_text", "quality")])
    tag = "_".join(Path(name).name for name in args.models)
    path = write_json(f"bench_engines_{tag}", {"args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
