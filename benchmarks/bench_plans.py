"""How rbcompile runs its regions, side by side on one machine: the region interpreter in eager
PyTorch (`interp`), each region compiled by inductor (`regions`, CompiledModel.compile_regions),
one inductor graph per plan (`plan`, CompiledModel.compile_plans), against transformers eager and
inductor on the whole model.

Prefill: a batch of real text (Emma) at the full path and at budgets, interleaved rounds (ABBA),
median ms. Each rbcompile row gives its max abs diff to the interpreter at the same plan (the
engines must agree) and, for budgets, the quality that plan costs on this batch: top-1 agreement
with the full path (decoders) or the cosine of mean-pooled embeddings (encoders).
Decode (decoders): `generate` with the KV-cached decoder, 1 x (prompt + N new tokens), greedy,
through the interpreter and through plan graphs, next to transformers `generate`; tokens/s
median of the timed runs, and whether the tokens equal the interpreter's.
`first call s` is the first call's time: the compile, for the compiled contenders.
Writes benchmarks/results/bench_plans_<models>.json.

    python benchmarks/bench_plans.py [--models smollm2-135m minilm-l6] [--budgets 0.1 0.25]
        [--rounds 7] [--new-tokens 32] [--threads 2]

A model is an artifact folder or a bundled name (compiled here, without calibration).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (interleaved_medians, load_with_eager, pin_threads, print_table,  # noqa: E402
                    text_windows, write_json)

from rbcompile.artifact import quality  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

SHAPES = {"encoder": (8, 64), "decoder": (1, 128)}   # batch x tokens of the prefill, per family
ENGINES = ("interp", "regions", "plan")


def _engine(name: str, engine: str):
    compiled, _ = load_with_eager(name)
    if engine == "regions":
        compiled.compile_regions()
    elif engine == "plan":
        compiled.compile_plans()
    return compiled


def _first_call(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _budget_quality(family: str, out, full, mask) -> str:
    if family == "decoder":
        agree = (out.argmax(-1) == full.argmax(-1))[mask.bool()].float().mean().item()
        return f"top-1 {agree:.1%}"
    cos = torch.nn.functional.cosine_similarity(quality.mean_pool(out, mask),
                                                quality.mean_pool(full, mask), dim=-1)
    return f"cos {cos.mean().item():.3f}"


def bench_prefill(name: str, budgets: list[float], rounds: int) -> list[dict]:
    with step(f"loading {name} four times (one per engine, and transformers)"):
        engines = {engine: _engine(name, engine) for engine in ENGINES}
        _, eager = load_with_eager(name)
    interp = engines["interp"]
    family, output = interp.family, interp.output_names[0]
    ids, mask = text_windows(interp.tokenizer, *SHAPES[family])
    extra = {"use_cache": False} if family == "decoder" else {}
    inductor = torch.compile(eager)

    def hf(model):
        return lambda: model(input_ids=ids, attention_mask=mask, **extra)[0]

    contenders = {"transformers eager": hf(eager), "transformers inductor": hf(inductor)}
    for engine, compiled in engines.items():
        for budget in (None, *budgets):
            label = f"rbcompile {engine} {'full' if budget is None else budget}"
            contenders[label] = (lambda c=compiled, b=budget: c(ids, mask, budget=b)[output])
    first = {}
    with torch.no_grad():
        for label, fn in contenders.items():
            with step(f"first call: {label}"):
                first[label] = _first_call(fn)
        say(f"== {name}: prefill {ids.shape[0]} x {ids.shape[1]} tokens, {rounds} rounds")
        timings = interleaved_medians(contenders, rounds)
        outputs = {label: fn() for label, fn in contenders.items()}
    rows = []
    for label, timing in timings.items():
        row = {"model": name, "case": f"prefill {ids.shape[0]}x{ids.shape[1]}",
               "contender": label, "first_call_s": first[label], **timing}
        if label.startswith("rbcompile"):
            _, engine, budget = label.split()
            same_plan = outputs[f"rbcompile interp {budget}"]
            row["max_abs_diff_vs_interp"] = (outputs[label] - same_plan).abs().max().item()
            if budget != "full":
                row["quality"] = _budget_quality(family, outputs[label],
                                                 outputs[f"rbcompile {engine} full"], mask)
        rows.append(row)
    eager_ms = timings["transformers eager"]["median_ms"]
    inductor_ms = timings["transformers inductor"]["median_ms"]
    for row in rows:
        row["vs_eager"], row["vs_inductor"] = (eager_ms / row["median_ms"],
                                               inductor_ms / row["median_ms"])
    return rows


def bench_decode(name: str, new_tokens: int, rounds: int) -> list[dict]:
    with step(f"loading {name} for decoding"):
        interp, eager = load_with_eager(name)
        plan = _engine(name, "plan")
    ids, _ = text_windows(interp.tokenizer, 1, 16)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def hf():
        with torch.no_grad():
            out = eager.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        return out[0, ids.shape[1]:].tolist()

    contenders = {"transformers generate": hf,
                  "rbcompile interp generate": lambda: interp.generate(
                      ids, max_new_tokens=new_tokens).tokens[0],
                  "rbcompile plan generate": lambda: plan.generate(
                      ids, max_new_tokens=new_tokens).tokens[0]}
    rows = []
    reference = None
    for label, fn in contenders.items():
        with step(f"first call: {label}"):
            first = _first_call(fn)
        times, tokens = [], None
        for _ in range(rounds):
            start = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - start)
        reference = tokens if label == "rbcompile interp generate" else reference
        median = statistics.median(times)
        rows.append({"model": name, "case": f"decode 1x({ids.shape[1]}+{new_tokens})",
                     "contender": label, "first_call_s": first, "median_ms": 1e3 * median,
                     "tokens_per_s": len(tokens) / median, "tokens": tokens})
    for row in rows:
        row["tokens_equal_interp"] = row["tokens"] == reference
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "minilm-l6"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.25])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if any(not 0 < b <= 1 for b in args.budgets) or args.rounds < 1 or args.new_tokens < 1:
        parser.error("budgets must be in (0, 1], --rounds and --new-tokens >= 1")
    pin_threads(args.threads)
    rows = []
    for name in args.models:
        rows += bench_prefill(name, args.budgets, args.rounds)
        if load_with_eager(name)[0].decoder is not None:
            rows += bench_decode(name, args.new_tokens, max(3, args.rounds // 2))
    table = [{**r, "median": f"{r['median_ms']:.1f}", "first": f"{r['first_call_s']:.1f}",
              "ratios": (f"{r['vs_eager']:.2f}x / {r['vs_inductor']:.2f}x" if "vs_eager" in r
                         else f"{r['tokens_per_s']:.1f} tok/s"),
              "check": (f"diff {r['max_abs_diff_vs_interp']:.1e}"
                        if "max_abs_diff_vs_interp" in r else
                        f"tokens {'equal' if r.get('tokens_equal_interp') else 'differ'}"
                        if "tokens" in r else "-"),
              "quality": r.get("quality", "-")} for r in rows]
    print("\nPrefill: median ms, and speed vs transformers eager / inductor on the whole model "
          "(> 1x: faster).\nDecode: tokens/s. check: max abs diff to the interpreter at the same "
          "plan, or greedy tokens vs the interpreter's.\n")
    print_table(table, [("model", "model"), ("case", "case"), ("contender", "contender"),
                        ("median", "median ms"), ("ratios", "vs eager / inductor"),
                        ("first", "first call s"), ("check", "check"),
                        ("quality", "budget quality")])
    tag = "_".join(Path(name).name for name in args.models)
    path = write_json(f"bench_plans_{tag}", {"args": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
