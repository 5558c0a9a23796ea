"""Prefill inside the continuous-batching engine, two scenarios on real text (Emma):

  burst  --requests requests arrive at once: newcomers prefilled together (`prefill_tokens`,
         2048 padded tokens per prefill forward) against one newcomer per step
         (`prefill_tokens=1`, the engine before issue 16's batched prefill).
  long   --streams short requests are decoding when one prompt of --long-tokens arrives (once
         each stream has --arrive-after tokens): chunked prefill (`prefill_chunk` 512 and 256:
         one chunk per step, before the decode step) against the whole prompt in one forward
         (`prefill_chunk=None`, the engine before chunking). The number to watch is the
         running streams' longest gap between two tokens: the stall the long prefill causes.

Each contender serves the same requests in-process on one `BatchEngine`, in alternating order
per round (ABBA). Reported per contender, medians over rounds: prefill forwards, time to first
token (p50 / max over the requests present at the start; `long`: also the long prompt's),
the streams' inter-token gap p99 / max, time until every request finished, aggregate tokens/s;
greedy tokens are checked identical across contenders.

    python benchmarks/bench_prefill.py --artifact build/smollm2-135m [--scenario burst|long]
        [--requests 16] [--streams 8] [--long-tokens 1536] [--new-tokens 32] [--rounds 2]
        [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import DATA, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.runtime.engine.core import EngineRequest  # noqa: E402

CONTENDERS = {
    "burst": {"together (prefill_tokens 2048)": {"prefill_tokens": 2048},
              "one per step (prefill_tokens 1)": {"prefill_tokens": 1}},
    "long": {"chunks of 512": {"prefill_chunk": 512}, "chunks of 256": {"prefill_chunk": 256},
             "whole prompt (no chunks)": {"prefill_chunk": None}},
}


@dataclass
class Arrival:
    prompt: list[int]
    new_tokens: int
    after_tokens: int = 0    # submitted once the engine has emitted this many tokens


def emma_prompts(tokenizer, words: list[int]) -> list[list[int]]:
    """Passages of Emma, one per entry of `words` (its length in words), 40 words apart."""
    text = (DATA / "emma-excerpt.txt").read_text().split()
    if len(text) < 40 * len(words) + max(words):
        raise SystemExit(f"emma-excerpt.txt has {len(text)} words, too few for these prompts")
    return [tokenizer(" ".join(text[40 * i: 40 * i + count]))["input_ids"]
            for i, count in enumerate(words)]


def scenario(args, tokenizer) -> list[Arrival]:
    if args.scenario == "burst":
        prompts = emma_prompts(tokenizer, [80 + 10 * i for i in range(args.requests)])
        return [Arrival(prompt, args.new_tokens) for prompt in prompts]
    *streams, long = emma_prompts(tokenizer, [80] * args.streams + [args.long_tokens])
    long = long[:args.long_tokens]
    return [*(Arrival(prompt, args.new_tokens) for prompt in streams),
            Arrival(long, args.new_tokens, args.arrive_after * args.streams)]


def serve(model, arrivals: list[Arrival], options: dict) -> dict:
    """Run the arrivals on a fresh engine with `options`; timings and tokens."""
    engine = model.batch_engine(max_batch=len(arrivals), **options)
    stamps = [[] for _ in arrivals]
    requests = [EngineRequest(a.prompt, a.new_tokens, on_token=lambda _, s=s: s.append(time.perf_counter()))
                for a, s in zip(arrivals, stamps)]
    pending = list(zip(arrivals, requests))
    start = time.perf_counter()
    while pending or engine.has_work:
        while pending and pending[0][0].after_tokens <= engine.stats.tokens:
            arrival, request = pending.pop(0)
            request.submitted = time.perf_counter()
            engine.submit(request)
        engine.step()
    seconds = time.perf_counter() - start
    first = [r for a, r in zip(arrivals, requests) if not a.after_tokens]
    late = [r for a, r in zip(arrivals, requests) if a.after_tokens]
    ttft = [r.first_token_at - r.submitted for r in first]
    gaps = sorted(b - a for r, s in zip(requests, stamps) if r in first for a, b in zip(s, s[1:]))
    return {"seconds": seconds, "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "late_ttft_s": max((r.first_token_at - r.submitted for r in late), default=0.0),
            "gap_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "gap_max_s": gaps[-1],
            "prefill_forwards": engine.stats.prefill_forwards,
            "tokens_per_s": sum(len(r.tokens) for r in requests) / seconds,
            "tokens": [request.tokens for request in requests]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="a compiled decoder artifact folder")
    parser.add_argument("--scenario", choices=tuple(CONTENDERS), default="burst")
    parser.add_argument("--requests", type=int, default=16, help="burst: requests at once")
    parser.add_argument("--streams", type=int, default=8, help="long: streams decoding")
    parser.add_argument("--long-tokens", type=int, default=1536, help="long: the long prompt")
    parser.add_argument("--arrive-after", type=int, default=8,
                        help="long: the long prompt arrives once each stream has this many tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="default benchmarks/results/bench_prefill_SCENARIO.json")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = rbcompile.load(args.artifact)
    arrivals = scenario(args, model.tokenizer)
    contenders = CONTENDERS[args.scenario]
    serve(model, [Arrival(a.prompt[:64], 2) for a in arrivals[:2]], {})   # warm-up
    runs = {name: [] for name in contenders}
    for round_index in range(args.rounds):
        order = list(contenders.items())
        for name, options in order[::-1] if round_index % 2 else order:
            runs[name].append(serve(model, arrivals, options))
            print(f"  round {round_index + 1}/{args.rounds} {name}: "
                  f"{runs[name][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    tokens = [run["tokens"] for name in contenders for run in runs[name]]
    keys = ("seconds", "ttft_p50_s", "ttft_max_s", "late_ttft_s", "gap_p99_s", "gap_max_s",
            "tokens_per_s", "prefill_forwards")
    rows = [{"contender": name, **{key: statistics.median(run[key] for run in results) for key in keys}}
            for name, results in runs.items()]
    lengths = sorted(len(a.prompt) for a in arrivals)
    print(f"\n{args.scenario}: {len(arrivals)} requests, prompts of {lengths[0]}-{lengths[-1]} tokens"
          + (f" (the long one arrives once each of the {args.streams} streams has "
             f"{args.arrive_after} tokens)" if args.scenario == "long" else ", at once")
          + f", {args.new_tokens} new tokens each, greedy, {args.threads} threads, medians of "
          f"{args.rounds} rounds")
    columns = [("contender", "contender"), ("forwards", "prefill forwards"),
               ("p50", "TTFT p50"), ("max", "TTFT max")]
    if args.scenario == "long":
        columns += [("late", "long prompt's TTFT"), ("gap99", "stream gap p99"), ("gap", "stream gap max")]
    columns += [("all", "all finished"), ("tok/s", "tokens/s")]
    print_table([{"contender": r["contender"], "forwards": f"{r['prefill_forwards']:.0f}",
                  "p50": f"{r['ttft_p50_s']:.2f} s", "max": f"{r['ttft_max_s']:.2f} s",
                  "late": f"{r['late_ttft_s']:.2f} s", "gap99": f"{r['gap_p99_s'] * 1000:.0f} ms",
                  "gap": f"{r['gap_max_s'] * 1000:.0f} ms", "all": f"{r['seconds']:.2f} s",
                  "tok/s": f"{r['tokens_per_s']:.1f}"} for r in rows], columns)
    identical = all(t == tokens[0] for t in tokens)
    print(f"greedy tokens identical across contenders and rounds: {identical}")
    path = write_json(f"bench_prefill_{args.scenario}", {"args": vars(args), "rows": rows,
                                                        "identical_tokens": identical}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
