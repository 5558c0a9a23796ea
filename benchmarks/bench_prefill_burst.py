"""A burst of requests arriving at once at the continuous-batching engine: newcomers prefilled
together (`prefill_tokens`, default 2048 padded tokens per prefill forward) against one
newcomer per step (`prefill_tokens=1`, the engine before issue 16's batched prefill).

Each contender serves the same requests (real text from benchmarks/data, prompts of different
lengths) in-process on one `BatchEngine`, alternating order per round (ABBA). Reported per
contender, medians over rounds: prefill forwards, time to first token (p50 / max over the
requests), time until every request finished, aggregate tokens/s; greedy tokens are checked
identical between the contenders.

    python benchmarks/bench_prefill_burst.py --artifact build/smollm2-135m [--requests 16]
        [--new-tokens 32] [--rounds 2] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import DATA, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.engine import EngineRequest  # noqa: E402

CONTENDERS = {"together (prefill_tokens 2048)": 2048, "one per step (prefill_tokens 1)": 1}


def burst_prompts(tokenizer, requests: int) -> list[list[int]]:
    """`requests` passages of Emma of 80 to 80 + 10 * (requests - 1) words."""
    words = (DATA / "emma-excerpt.txt").read_text().split()
    need = 80 + 10 * (requests - 1)
    if len(words) < need + 40 * requests:
        raise SystemExit(f"emma-excerpt.txt has {len(words)} words, need {need + 40 * requests}")
    return [tokenizer(" ".join(words[40 * i: 40 * i + 80 + 10 * i]))["input_ids"]
            for i in range(requests)]


def serve_burst(model, prompts, new_tokens: int, prefill_tokens: int) -> dict:
    engine = model.batch_engine(max_batch=len(prompts), prefill_tokens=prefill_tokens)
    requests = [EngineRequest(prompt, new_tokens) for prompt in prompts]
    start = time.perf_counter()
    for request in requests:
        engine.submit(request)
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    ttft = [request.first_token_at - start for request in requests]
    return {"seconds": seconds, "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "prefill_forwards": engine.stats.prefill_forwards,
            "tokens_per_s": sum(len(r.tokens) for r in requests) / seconds,
            "tokens": [request.tokens for request in requests]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="a compiled decoder artifact folder")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="default benchmarks/results/bench_prefill_burst.json")
    args = parser.parse_args()
    pin_threads(args.threads)
    model = rbcompile.load(args.artifact)
    prompts = burst_prompts(model.tokenizer, args.requests)
    serve_burst(model, prompts[:2], 2, 2048)   # warm-up
    runs = {name: [] for name in CONTENDERS}
    for round_index in range(args.rounds):
        order = list(CONTENDERS.items())
        for name, prefill_tokens in order[::-1] if round_index % 2 else order:
            runs[name].append(serve_burst(model, prompts, args.new_tokens, prefill_tokens))
            print(f"  round {round_index + 1}/{args.rounds} {name}: "
                  f"{runs[name][-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    tokens = [run["tokens"] for name in CONTENDERS for run in runs[name]]
    rows = []
    for name, results in runs.items():
        median = {key: statistics.median(run[key] for run in results)
                  for key in ("seconds", "ttft_p50_s", "ttft_max_s", "tokens_per_s", "prefill_forwards")}
        rows.append({"contender": name, **median})
    print(f"\n{args.requests} requests at once, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, greedy, "
          f"{args.threads} threads, medians of {args.rounds} rounds")
    print_table([{"contender": r["contender"], "forwards": f"{r['prefill_forwards']:.0f}",
                  "p50": f"{r['ttft_p50_s']:.2f} s", "max": f"{r['ttft_max_s']:.2f} s",
                  "all": f"{r['seconds']:.2f} s", "tok/s": f"{r['tokens_per_s']:.1f}"}
                 for r in rows],
                [("contender", "contender"), ("forwards", "prefill forwards"),
                 ("p50", "TTFT p50"), ("max", "TTFT max"), ("all", "all finished"),
                 ("tok/s", "tokens/s")])
    identical = all(t == tokens[0] for t in tokens)
    print(f"greedy tokens identical across contenders and rounds: {identical}")
    path = write_json("bench_prefill_burst", {"args": vars(args), "rows": rows,
                                              "identical_tokens": identical}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
