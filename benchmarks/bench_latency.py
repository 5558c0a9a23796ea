"""Latency of the generated module vs eager transformers, full path and budgets, on real text.

For each model and batch size, the contenders run interleaved (one call each per round):
eager (the transformers model), rbcompile full path, and rbcompile at each budget. Printed:
median latency, speedup over eager, and the quality cost of each budget on the same inputs
(decoders: top-1 next-token agreement with the full path; encoders: cosine of mean-pooled
embeddings to the full path). Writes benchmarks/results/bench_latency.json.

    python benchmarks/bench_latency.py [--models minilm-l6 smollm2-135m] [--rounds 7]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import interleaved_medians, pin_threads, print_table, text_windows, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.artifact.guard import UNGUARDED  # noqa: E402
from rbcompile.artifact.models import load_hf_model, resolve_checkpoint  # noqa: E402

DEFAULT_SEQ = {"minilm-l6": 64, "smollm2-135m": 64}


def _quality(family: str, full: dict, light: dict, mask: torch.Tensor) -> float:
    if family == "decoder":
        return (full["logits"].argmax(-1) == light["logits"].argmax(-1)).float().mean().item()
    m = mask.unsqueeze(-1).float()
    pool = lambda h: torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)  # noqa: E731
    return (pool(full["last_hidden_state"]) * pool(light["last_hidden_state"])).sum(-1).mean().item()


def bench_model(name: str, batches: list[int], budgets: list[float], rounds: int, seq: int) -> list[dict]:
    print(f"== {name}: compiling", file=sys.stderr)
    compiled = rbcompile.compile(name)
    compiled.guard = UNGUARDED   # it times every budget, its quality measured beside it
    eager = load_hf_model(resolve_checkpoint(name))
    extra = {"use_cache": False} if compiled.family == "decoder" else {}
    rows = []
    for batch in batches:
        input_ids, mask = text_windows(compiled.tokenizer, batch, seq)
        with torch.no_grad():
            contenders = {"eager": lambda: eager(input_ids=input_ids, attention_mask=mask, **extra),
                          "full": lambda: compiled(input_ids, mask)}
            for b in budgets:
                contenders[f"budget {b}"] = lambda b=b: compiled(input_ids, mask, budget=b)
            print(f"== {name} batch {batch} x {seq} tokens: {len(contenders)} contenders, "
                  f"{rounds} rounds", file=sys.stderr)
            timings = interleaved_medians(contenders, rounds)
            full = compiled(input_ids, mask)
            eager_out = eager(input_ids=input_ids, attention_mask=mask, **extra)
        parity = max((full[k] - eager_out[k]).abs().max().item() for k in compiled.output_names)
        for contender, t in timings.items():
            budget = float(contender.split()[1]) if contender.startswith("budget") else 0.0
            row = {"model": name, "batch": batch, "seq": seq, "contender": contender,
                   "budget": budget, **t,
                   "speedup_vs_eager": timings["eager"]["median_ms"] / t["median_ms"],
                   "speedup_vs_full": timings["full"]["median_ms"] / t["median_ms"]}
            if contender.startswith("budget"):
                out = compiled(input_ids, mask, budget=budget)
                row["skipped_prunable_flops"] = out.skipped_flops
                row["quality_vs_full"] = _quality(compiled.family, full, out, mask)
            elif contender == "full":
                row["max_abs_diff_vs_eager"] = parity
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_SEQ))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.5])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, help="tokens per sequence (default per model)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pin_threads(args.threads)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.batches, args.budgets, args.rounds,
                            args.seq or DEFAULT_SEQ.get(name, 64))
    table = [{**r, "median": f"{r['median_ms']:.1f}", "vs_eager": f"{r['speedup_vs_eager']:.3f}x",
              "vs_full": f"{r['speedup_vs_full']:.3f}x",
              "skipped": f"{r['skipped_prunable_flops']:.1%}" if "skipped_prunable_flops" in r else "-",
              "quality": f"{r['quality_vs_full']:.4f}" if "quality_vs_full" in r else "-"}
             for r in rows]
    print("\nLatency on real text (Emma), interleaved rounds, median ms; quality of a budget is "
          "measured on the same inputs\n(decoder: top-1 next-token agreement with the full path; "
          "encoder: cosine of mean-pooled embeddings to the full path)\n")
    print_table(table, [("model", "model"), ("batch", "batch"), ("seq", "seq"),
                        ("contender", "contender"), ("median", "median ms"),
                        ("vs_eager", "vs eager"), ("vs_full", "vs full"),
                        ("skipped", "skipped FLOPs"), ("quality", "quality")])
    overheads = [(r["model"], r["batch"], 1 / r["speedup_vs_eager"] - 1)
                 for r in rows if r["contender"] == "full"]
    print("\nGenerated full path vs eager (target: overhead <= 3%):")
    for model, batch, overhead in overheads:
        verdict = "ok" if overhead <= 0.03 else "OVER TARGET"
        print(f"  {model} batch {batch}: {overhead:+.1%} ({verdict})")
    path = write_json("bench_latency", {"args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
