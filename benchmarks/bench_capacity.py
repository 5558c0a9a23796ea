"""Closed-loop capacity of serving settings: how many requests per busy second the runtime
serves at a fixed decision, next to what that decision costs in quality.

Every setting serves the same midday mix of easy and hard inputs (all queued at once, batches of
--max-batch, no result cache), in ABBA rounds; capacity is the median over the rounds and the
ratio is against the full model (no tiers, no early exit, no fallback) in the same round.
Quality: agreement with the full path's answer, and accuracy where the workload has labels.

A setting is BUDGET:TIER_SHIFT:FALLBACK:EXIT, e.g. 0.25:1:0:1 = budget 0.25, every request
light, no confidence fallback (1: the realtime-chat preset), early exit at the off-ramps on.

    python benchmarks/bench_capacity.py --model build/minilm-mr \\
        --workload ~/.cache/rbcompile/mr/test.jsonl ~/.cache/rbcompile/mr/reviews.jsonl
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_tidal import (NO_FALLBACK, closed_loop, full_references, midday_sample,  # noqa: E402
                         split_easy_hard, workload)
from common import pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.runtime.control.complexity import Tiers  # noqa: E402
from rbcompile.runtime.control.policy import StaticPolicy  # noqa: E402
from rbcompile.runtime.control.server import PRESETS, ServerConfig  # noqa: E402

DEFAULT_SETTINGS = "0:0:1:1,0:0:0:1,0.25:1:0:0,0.25:1:0:1,0.35:1:0:1,0.5:1:0:1"


def parse_setting(spec: str) -> tuple[StaticPolicy, bool, bool]:
    try:
        budget, shift, fallback, early_exit = spec.split(":")
        return (StaticPolicy(float(budget), use_cache=False, tier_shift=float(shift)),
                fallback == "1", early_exit == "1")
    except ValueError as exc:
        raise SystemExit(f"bad setting {spec!r} (want BUDGET:TIER_SHIFT:FALLBACK:EXIT): {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="calibrated artifact folder")
    parser.add_argument("--workload", nargs="+", help="as in bench_tidal.py")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pin_threads(args.threads)

    compiled = rbcompile.load(args.model)
    items, labels = workload(compiled, args.workload, args.max_tokens, pool=12000)
    easy, hard = split_easy_hard(compiled, items)
    sample = midday_sample(easy, hard, args.requests, seed=1)
    references = full_references(compiled, items, set(sample))
    base = dict(max_batch=args.max_batch, max_tokens=args.max_tokens)
    contenders = {"full": (StaticPolicy(0.0, use_cache=False),
                           ServerConfig(**base, tiers=Tiers(0.0, 0.0), early_exit=False,
                                        preset=NO_FALLBACK))}
    for spec in args.settings.split(","):
        policy, fallback, early_exit = parse_setting(spec)
        contenders[spec] = (policy, ServerConfig(**base, early_exit=early_exit, preset=(
            PRESETS["realtime-chat"] if fallback else NO_FALLBACK)))
    capacity = {name: [] for name in contenders}
    quality = {}
    for round_index in range(args.rounds):
        order = list(contenders) if round_index % 2 == 0 else list(contenders)[::-1]
        for name in order:
            print(f"-- round {round_index + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            policy, config = contenders[name]
            rps, responses = closed_loop(compiled, policy, config, [items[i] for i in sample])
            capacity[name].append(rps)
            quality[name] = (responses, sample)  # answers do not depend on the round
    rows = []
    for name, (responses, served) in quality.items():
        answers = [r.outputs for r in responses]
        if "logits" in answers[0]:
            predicted = [int(a["logits"].argmax()) for a in answers]
            agree = statistics.mean(p == references[i]["label"] for p, i in zip(predicted, served))
            scored = [p == labels[i] for p, i in zip(predicted, served)
                      if labels and labels[i] is not None]
        else:
            agree = statistics.mean(int(a["next_token"]) == references[i]["next_token"]
                                    for a, i in zip(answers, served))
            scored = []
        ratios = [c / f for c, f in zip(capacity[name], capacity["full"])]
        rows.append({"setting": name, "capacity_rps": statistics.median(capacity[name]),
                     "vs_full": statistics.median(ratios), "agreement": agree,
                     "accuracy": statistics.mean(scored) if scored else None,
                     "labelled": len(scored),
                     "exits": sum(r.exit_layer >= 0 for r in responses),
                     "retries": sum(r.fallback_steps for r in responses)})
    print(f"\n{Path(args.model).name}: closed-loop capacity on a midday mix of {args.requests} "
          f"requests, medians of {args.rounds} ABBA rounds; setting = budget:tier shift:"
          "fallback:early exit")
    print_table([{**r, **{k: f"{r[k]:.3f}" for k in ("capacity_rps", "vs_full", "agreement")},
                  "accuracy": "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"}
                 for r in rows],
                [("setting", "setting"), ("capacity_rps", "req/s busy"), ("vs_full", "x full"),
                 ("agreement", "agree"), ("accuracy", "accuracy"), ("labelled", "n labelled"),
                 ("exits", "exits"), ("retries", "retries")])
    path = write_json(f"bench_capacity_{Path(args.model).name}",
                      {"model": args.model, "rows": rows, "args": vars(args)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
