"""What stacked projections (q / k / v and gate / up as one matmul each:
passes/fuse_projections.py) do to a prefill and to a decode step, on real weights.

    python benchmarks/bench_stacking.py [--model smollm2-135m] [--batches 1 8]
        [--context 128] [--rounds 40] [--threads 2] [--device cpu|cuda] [--json PATH]

Both artifacts are compiled here from the same checkpoint. Per batch size, on the same real
text (`--context` tokens of Emma per row): a prefill (the main module's full path over the
rows) and one decode step of the KV-cached decoder after prefilling them (the same step every
round: it writes the same cache slot), each timed for both artifacts in turn (ABBA,
`common.interleaved_medians`). Quality is the logits against the unstacked artifact's: max abs
difference and whether every position's top token is the same. Writes
benchmarks/results/bench_stacking.json.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from common import interleaved_medians, pin_threads, print_table, text_windows, write_json


def prefilled(compiled, input_ids: torch.Tensor):
    """A decode step's arguments after prefilling `input_ids` into a fresh cache."""
    from rbcompile.artifact.cache_pool import zeros
    from rbcompile.runtime.engine.kv_cache import step_inputs

    decoder, shape = compiled.decoder, compiled.decoder.shape
    batch, tokens = input_ids.shape
    slots, pads = tokens + 64, torch.zeros(batch, dtype=torch.long, device=shape.device)
    cache = zeros(2 * shape.layers, (batch, shape.kv_heads, slots, shape.head_dim), shape.dtype,
                  shape.device)
    last = torch.tensor([tokens - 1], device=shape.device)
    logits = decoder(input_ids, *step_inputs(pads, 0, tokens, slots), last, cache)
    next_ids = logits[:, -1].argmax(-1, keepdim=True)
    return (next_ids, *step_inputs(pads, tokens, 1, slots),
            torch.zeros(1, dtype=torch.long, device=shape.device), cache)


def main(argv=None):
    import rbcompile
    from rbcompile.artifact.models import load_tokenizer, resolve_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="bundled name or checkpoint")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=128, help="prefilled tokens per row")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="where to write (default results/)")
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    variants = {}
    for name, stack in (("unstacked", False), ("stacked", True)):
        start = time.perf_counter()
        variants[name] = rbcompile.compile(args.model, device=args.device, stack_projections=stack)
        print(f"# compiled {name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    tokenizer = load_tokenizer(resolve_checkpoint(args.model))
    rows = []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for batch in args.batches:
        input_ids, mask = text_windows(tokenizer, batch, args.context)
        input_ids, mask = input_ids.to(args.device), mask.to(args.device)
        steps = {name: prefilled(compiled, input_ids) for name, compiled in variants.items()}
        runs = {"prefill": {name: (lambda n=name: variants[n](input_ids, mask)["logits"])
                            for name in variants},
                "decode step": {name: (lambda n=name: variants[n].decoder(*steps[n]))
                                for name in variants}}
        for kind, run in runs.items():
            with torch.no_grad():
                logits = {name: fn() for name, fn in run.items()}
                times = interleaved_medians({name: (lambda fn=fn: (fn(), sync()))
                                             for name, fn in run.items()}, args.rounds)
            base = times["unstacked"]["median_ms"]
            for name in variants:
                diff = (logits[name] - logits["unstacked"]).abs().max().item()
                same = bool(torch.equal(logits[name].argmax(-1), logits["unstacked"].argmax(-1)))
                rows.append({"batch": batch, "run": kind, "artifact": name,
                             "median_ms": times[name]["median_ms"], "min_ms": times[name]["min_ms"],
                             "speedup": base / times[name]["median_ms"],
                             "max_abs_logit_diff": diff, "same_top_tokens": same})
    print(f"{args.model} ({args.device}, {args.threads} threads, {args.context} tokens per row), "
          f"median of {args.rounds} interleaved rounds; quality vs unstacked")
    print_table([{**row, "median_ms": f"{row['median_ms']:.2f}", "min_ms": f"{row['min_ms']:.2f}",
                  "speedup": f"{row['speedup']:.2f}x",
                  "max_abs_logit_diff": f"{row['max_abs_logit_diff']:.1e}"} for row in rows],
                [("batch", "batch"), ("run", "run"), ("artifact", "artifact"), ("median_ms", "median ms"),
                 ("min_ms", "min ms"), ("speedup", "vs unstacked"),
                 ("max_abs_logit_diff", "max |logit diff|"), ("same_top_tokens", "same top tokens")])
    path = write_json("bench_stacking", {"model": args.model, "device": args.device,
                                            "context": args.context, "rounds": args.rounds,
                                            "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
