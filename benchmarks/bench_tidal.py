"""The tidal benchmark: a day of traffic whose rate swings 17x and whose hard share swings 43
points, replayed in real time against the serving runtime, one contender after another.

Contenders (same trace, same server and batching):
  static-full   the full model for every request: no tiers, no early exit, no result cache,
                no confidence fallback
  static-light  one plan for every request: the largest calibrated budget whose held-out
                quality loss is <= 1 point; no tiers, early exit, result cache or fallback
  pid           the adaptive runtime (complexity tiers, early exit at off-ramps, result cache)
                with PID on the p99 latency SLO moving the budget (0 .. the largest plan) and,
                past the largest plan, the tier thresholds (up to --pid-tier-shift)
  ppo           the adaptive runtime with the PPO policy from `rbcompile train-policy`
                (INT8, 5 ms fallback to static-full)

Load: the peak rate is `--peak-load` times the full model's measured capacity (requests per
second of busy time, measured first in closed loop); the night rate is 1/17 of the peak. The
SLO is `--slo-batches` full-path batch service times, or `--slo-ms`.

Reported per contender: throughput (completed / busy seconds: the capacity the policy leaves),
p50 / p99 end-to-end latency, quality (MR accuracy and agreement with the full model's answer;
decoders: next-token agreement and perplexity ratio of the scored text), shed and lost
requests, cache hits, early exits, policy fallbacks and monitoring overhead. Ratios are against
static-full in the same run. Writes benchmarks/results/bench_tidal.json and bench_tidal.png.

    python benchmarks/bench_tidal.py --model build/minilm-mr --ppo build/minilm-mr-policy \\
        --workload ~/.cache/rbcompile/mr/test.jsonl ~/.cache/rbcompile/mr/reviews.jsonl
    python benchmarks/bench_tidal.py --model build/smollm2-calib --ppo build/smollm2-policy
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import DATA, RESULTS, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.calibration_data import load_labelled  # noqa: E402
from rbcompile.runtime.control.complexity import Tiers  # noqa: E402
from rbcompile.runtime.control.pid import PIDConfig  # noqa: E402
from rbcompile.runtime.control.policy import GuardedPolicy, PIDPolicy, StaticPolicy  # noqa: E402
from rbcompile.runtime.control.server import PRESETS, AdaptiveServer, Preset, ServerConfig  # noqa: E402
from rbcompile.runtime.control.workload import hard_share, tidal_rate, tidal_trace  # noqa: E402


NO_FALLBACK = Preset(confidence_threshold=0.0, max_fallback_steps=0, cache_keep=1.0)


def workload(compiled, sources: list[str] | None, max_tokens: int, pool: int, seed: int = 0):
    """(token id tensors, labels or None): JSONL texts (the first file whole, the others sampled
    to fill `pool` inputs; accuracy counts the first file's labels only, the others are served
    and compared with the full model), or plain text files (default: the bundled excerpts) cut
    into chunks of 16..max_tokens tokens."""
    tokenizer = compiled.tokenizer
    rng = random.Random(seed)
    if sources and all(Path(source).suffix == ".jsonl" for source in sources):
        texts, labels = load_labelled(Path(sources[0]))
        rest = [row for source in sources[1:] for row in zip(*load_labelled(Path(source)))]
        for text, _ in rng.sample(rest, max(0, min(len(rest), pool - len(texts)))):
            texts.append(text)
            labels.append(None)
        ids = [tokenizer(t, truncation=True, max_length=max_tokens, return_tensors="pt")["input_ids"][0]
               for t in texts]
        return ids, labels
    files = sources or [DATA / f for f in ("tempest-excerpt.txt", "emma-excerpt.txt")]
    text = " ".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    stream = tokenizer(text, return_tensors="pt")["input_ids"][0]
    items, at = [], 0
    while at + 16 < len(stream) and len(items) < pool:
        length = rng.randint(16, max_tokens)
        items.append(stream[at:at + length])
        at += length
    return items, None


def split_easy_hard(compiled, items, hard_fraction: float = 0.4):
    """Hard = the top `hard_fraction` by the cheap complexity score (length, rare tokens)."""
    from rbcompile.artifact.input_complexity import LengthRarityComplexity
    score = LengthRarityComplexity(compiled.vocab_size)
    scores = [float(score(i[None], torch.ones_like(i[None]))) for i in items]
    order = sorted(range(len(items)), key=lambda i: scores[i])
    cut = int(len(items) * (1 - hard_fraction))
    return order[:cut], order[cut:]


def light_budget(compiled) -> float:
    """The largest plan budget whose held-out quality is within 1 point of the full path."""
    plans = compiled.plans
    key = "accuracy" if "accuracy" in plans[0].heldout else "top1_agreement" \
        if "top1_agreement" in plans[0].heldout else "cosine"
    full = plans[0].heldout[key] if key != "top1_agreement" else 1.0
    within = [p.budget for p in plans if full - p.heldout[key] <= 0.01]
    nonzero = [p.budget for p in plans if p.budget > 0]
    return max(within) if max(within) > 0 else min(nonzero)


def midday_sample(easy, hard, count: int, seed: int = 0) -> list[int]:
    """`count` workload indices drawn with the midday share of hard inputs."""
    rng = random.Random(seed)
    share = hard_share(0.5, 1.0)
    return [rng.choice(hard if rng.random() < share else easy) for _ in range(count)]


def closed_loop(compiled, policy, config: ServerConfig, inputs: list[torch.Tensor]):
    """Queue every input at once; (completed requests per busy second, responses in order)."""
    with AdaptiveServer(compiled, policy, config) as server:
        responses = [f.result() for f in [server.submit(input_ids=ids) for ids in inputs]]
    return server.counters["completed"] / server.counters["busy_s"], responses


def measure_capacity(compiled, items, easy, hard, config: ServerConfig, count: int = 160,
                     seed: int = 0) -> float:
    """Full-path requests per busy second, closed loop, on the midday mix of easy and hard inputs."""
    sample = midday_sample(easy, hard, count, seed)
    return closed_loop(compiled, StaticPolicy(0.0, use_cache=False), config,
                       [items[i] for i in sample])[0]


def replay(compiled, policy, trace, items, config: ServerConfig):
    """Submit the trace in real time; returns per-request records and the server."""
    server = AdaptiveServer(compiled, policy, config)
    submitted = []
    with server:
        start = time.monotonic()
        for index, request in enumerate(trace):
            delay = start + request.time - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            submitted.append((request, time.monotonic() - start,
                              server.submit(input_ids=items[request.item], qos=request.qos)))
            if index % 200 == 0:
                print(f"    t={request.time:5.1f}s  {index}/{len(trace)} requests, queue "
                      f"{len(server._queue)}", file=sys.stderr, flush=True)
    records = []
    for request, at, future in submitted:
        error = future.exception()
        records.append({"t": at, "item": request.item, "hard": request.hard, "qos": request.qos,
                        "error": str(error) if error else None,
                        "response": None if error else future.result()})
    decisions = [(t - start, d.budget, d.tier_shift) for t, d, _ in server.decisions]
    return records, server, decisions


def quality(compiled, records, references, labels) -> dict:
    served = [r for r in records if r["response"] is not None]
    if compiled.family == "encoder":
        predictions = [int(r["response"].outputs["logits"].argmax()) for r in served]
        agree = statistics.mean(p == references[r["item"]]["label"] for p, r in zip(predictions, served))
        out = {"agreement": agree}
        scored = [(p, labels[r["item"]]) for p, r in zip(predictions, served)
                  if labels and labels[r["item"]] is not None]
        if scored:
            out["accuracy"] = statistics.mean(p == label for p, label in scored)
        return out
    agree = statistics.mean(int(r["response"].outputs["next_token"]) ==
                            references[r["item"]]["next_token"] for r in served)
    nll = sum(-float(r["response"].outputs["token_logprobs"].sum()) for r in served)
    ref_nll = sum(references[r["item"]]["nll"] for r in served)
    tokens = sum(len(r["response"].outputs["token_logprobs"]) for r in served)
    return {"agreement": agree, "perplexity_ratio": math.exp((nll - ref_nll) / tokens)}


def full_references(compiled, items, wanted) -> dict[int, dict]:
    """Full-path answers of the workload items in `wanted` (those the trace uses)."""
    from rbcompile.runtime.control.executor import TieredExecutor, pad_batch
    from rbcompile.runtime.control.policy import Decision
    executor = TieredExecutor(compiled, tiers=Tiers(0.0, 0.0))  # every row full: no exits
    order, refs = sorted(wanted), {}
    for i in range(0, len(order), 16):
        ids, mask = pad_batch([items[j] for j in order[i:i + 16]])
        for index, result in zip(order[i:i + 16], executor.run(ids, mask, Decision())):
            out = result.outputs
            refs[index] = ({"label": int(out["logits"].argmax())} if "logits" in out else
                        {"next_token": int(out["next_token"]),
                         "nll": -float(out["token_logprobs"].sum())} if "next_token" in out else {})
    return refs


def summarise(name, records, server, references, labels, compiled, day_s) -> dict:
    latencies = sorted(r["response"].latency_s for r in records if r["response"] is not None)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    c = server.counters
    guarded = server.policy if isinstance(server.policy, GuardedPolicy) else None
    return {"contender": name, "requests": len(records), "completed": c["completed"],
            "shed": c["shed"] + c["rejected"], "lost": c["admitted"] - c["completed"],
            "throughput_rps": c["completed"] / max(c["busy_s"], 1e-9),
            "offered_rps": len(records) / day_s,
            "p50_ms": 1e3 * pick(0.5), "p99_ms": 1e3 * pick(0.99),
            "mean_budget": statistics.mean(d.budget for _, d, _ in server.decisions),
            "mean_tier_shift": statistics.mean(d.tier_shift for _, d, _ in server.decisions),
            "cache_hits": c["cache_hits"], "fallback_steps": c["fallback_steps"],
            "early_exits": sum(1 for r in records if r["response"] is not None
                               and r["response"].exit_layer >= 0),
            "policy_fallbacks": guarded.fallbacks if guarded else 0,
            "monitor_overhead": server.sampler.overhead(),
            "monitor_cpu_overhead": server.sampler.cpu_overhead(),
            **quality(compiled, records, references, labels)}


def median_row(rounds: list[dict]) -> dict:
    """Per numeric field, the median over the rounds (ratios are taken within a round first)."""
    row = dict(rounds[0])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = statistics.median(r[key] for r in rounds)
    return row


def plot(path: Path, title: str, trace_info, timelines: dict, slo_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    day, night = trace_info
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ts = [day * i / 200 for i in range(201)]
    axes[0].plot(ts, [tidal_rate(t, day, night) for t in ts], label="arrival rate (req/s)")
    ax2 = axes[0].twinx()
    ax2.plot(ts, [100 * hard_share(t, day) for t in ts], "--", color="grey", label="hard share (%)")
    axes[0].set_ylabel("req/s")
    ax2.set_ylabel("hard %")
    axes[0].set_title(title)
    for name, (decisions, latencies) in timelines.items():
        if decisions:
            line, = axes[1].step([t for t, _, _ in decisions], [b for _, b, _ in decisions],
                                 where="post", label=name, alpha=0.8)
            if any(s for _, _, s in decisions):
                axes[1].step([t for t, _, _ in decisions], [s for _, _, s in decisions],
                             where="post", ls="--", color=line.get_color(), alpha=0.8,
                             label=f"{name} tier shift")
        axes[2].plot(*zip(*latencies), label=name, alpha=0.8) if latencies else None
    axes[2].axhline(1e3 * slo_s, color="red", ls=":", label="SLO")
    axes[1].set_ylabel("budget (tier shift) chosen")
    axes[2].set_ylabel("p99 latency, 2 s windows (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds into the day")
    for ax in axes[1:]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rolling_p99(records, window: float = 2.0):
    done = sorted((r["t"] + r["response"].latency_s, r["response"].latency_s) for r in records
                  if r["response"] is not None)
    points, end = [], window
    while done and end <= done[-1][0] + window:
        inside = sorted(lat for t, lat in done if end - window <= t < end)
        if inside:
            points.append((end, 1e3 * inside[min(len(inside) - 1, int(0.99 * len(inside)))]))
        end += window / 2
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="calibrated artifact folder")
    parser.add_argument("--workload", nargs="+", help="JSONL files with text (+ label): the first "
                        "whole, the others sampled up to --pool; or plain text files, cut into "
                        "chunks; default: the bundled text excerpts")
    parser.add_argument("--pool", type=int, default=12000, help="distinct workload inputs")
    parser.add_argument("--ppo", help="folder written by `rbcompile train-policy`")
    parser.add_argument("--day-s", type=float, default=60.0, help="length of the replayed day")
    parser.add_argument("--peak-load", type=float, default=1.3,
                        help="peak rate / full-model capacity")
    parser.add_argument("--slo-batches", type=float, default=3.0,
                        help="SLO = this many full-path batch service times (default 3)")
    parser.add_argument("--slo-ms", type=float,
                        help="SLO in ms (overrides --slo-batches; use the policy's training SLO)")
    parser.add_argument("--pid-tier-shift", type=float, default=1.0,
                        help="how far PID may move the tier thresholds past the largest budget")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", default="static-full,static-light,pid,ppo")
    parser.add_argument("--preset", default="realtime-chat", choices=[*PRESETS, "none"],
                        help="confidence fallback of the adaptive contenders (none: off)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="replays per contender, in ABBA order; medians are reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pin_threads(args.threads)

    compiled = rbcompile.load(args.model)
    name = Path(args.model).name
    items, labels = workload(compiled, args.workload, args.max_tokens, args.pool, args.seed)
    easy, hard = split_easy_hard(compiled, items)
    base = ServerConfig(max_batch=args.max_batch, max_tokens=args.max_tokens)
    capacity = measure_capacity(compiled, items, easy, hard, base, seed=args.seed)
    peak = args.peak_load * capacity
    slo = args.slo_ms / 1e3 if args.slo_ms else args.slo_batches * args.max_batch / capacity
    config = ServerConfig(max_batch=args.max_batch, max_tokens=args.max_tokens, slo_s=slo,
                          preset=NO_FALLBACK if args.preset == "none" else PRESETS[args.preset])
    trace = tidal_trace(easy, hard, duration=args.day_s, night_rate=peak / 17, seed=args.seed)
    used = {r.item for r in trace}
    distinct = len(used)
    if distinct < 0.88 * len(trace):  # the trace repeats 10% on purpose; more hits the cache unfairly
        print(f"   warning: only {distinct} distinct inputs for {len(trace)} requests: raise --pool",
              file=sys.stderr)
    light = light_budget(compiled)
    print(f"== {name}: {len(items)} workload inputs ({len(hard)} hard); computing full-path "
          f"references of the {distinct} the trace uses", file=sys.stderr)
    references = full_references(compiled, items, used)
    print(f"   full-path capacity {capacity:.1f} req/s; peak {peak:.1f} req/s, night "
          f"{peak / 17:.2f} req/s; SLO {1e3 * slo:.0f} ms; {len(trace)} requests; light budget "
          f"{light:.2f}", file=sys.stderr)
    max_budget = max(p.budget for p in compiled.plans)
    static = dict(max_batch=args.max_batch, max_tokens=args.max_tokens, slo_s=slo,
                  early_exit=False, preset=NO_FALLBACK)
    contenders = {  # name -> (policy factory, server config)
        "static-full": (lambda: StaticPolicy(0.0, use_cache=False),
                        ServerConfig(**static, tiers=Tiers(0.0, 0.0))),
        "static-light": (lambda: StaticPolicy(light, use_cache=False),
                         ServerConfig(**static, tiers=Tiers(1.0, 1.0))),
        "pid": (lambda: PIDPolicy(PIDConfig(setpoint=slo, period_s=0.25), max_budget=max_budget,
                                  max_tier_shift=args.pid_tier_shift), config),
    }
    if args.ppo:
        from rbcompile.runtime.control.ppo import PPOPolicy
        contenders["ppo"] = (lambda: GuardedPolicy(PPOPolicy.load(args.ppo), StaticPolicy(0.0)),
                             config)
    wanted = [c for c in args.contenders.split(",") if c in contenders]
    runs, timelines = {c: [] for c in wanted}, {}
    for round_index in range(args.rounds):  # ABBA order: drift of the machine hits all alike
        for contender in (wanted if round_index % 2 == 0 else wanted[::-1]):
            print(f"-- round {round_index + 1}/{args.rounds}, {contender}: replaying "
                  f"{args.day_s:.0f} s", file=sys.stderr)
            make_policy, server_config = contenders[contender]
            records, server, decisions = replay(compiled, make_policy(), trace, items, server_config)
            runs[contender].append(summarise(contender, records, server, references, labels,
                                             compiled, args.day_s))
            timelines.setdefault(contender, (decisions, rolling_p99(records)))
    for round_index in range(args.rounds):
        full = runs[wanted[0]][round_index]
        for contender in wanted:
            row = runs[contender][round_index]
            row["p99_vs_full"] = row["p99_ms"] / full["p99_ms"]
            row["throughput_vs_full"] = row["throughput_rps"] / full["throughput_rps"]
            metric = "accuracy" if "accuracy" in row else "agreement"
            row["quality_loss_points"] = 100 * (full[metric] - row[metric])
    rows = [median_row(runs[c]) for c in wanted]
    full = rows[0]
    metric = "accuracy" if "accuracy" in full else "agreement"
    print(f"\n{name}: {len(trace)} requests over a {args.day_s:.0f} s day, peak "
          f"{args.peak_load:.2f}x full-model capacity, SLO {1e3 * slo:.0f} ms, confidence "
          f"fallback {args.preset}; medians of {args.rounds} rounds (ratios within a round)")
    counts = {"completed", "shed", "lost", "early_exits", "cache_hits", "fallback_steps",
              "policy_fallbacks"}
    print_table([{**r, **{k: f"{r[k]:.0f}" if k in counts else
                          f"{r[k]:.3f}" if isinstance(r[k], float) else r[k]
                          for k in r if k != "contender"}} for r in rows],
                [("contender", "contender"), ("throughput_rps", "req/s busy"),
                 ("throughput_vs_full", "x full"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
                 ("p99_vs_full", "p99/full"), (metric, metric),
                 *([("agreement", "agree")] if metric != "agreement" else []),
                 ("quality_loss_points", "loss pts"), ("mean_budget", "budget"),
                 ("mean_tier_shift", "shift"),
                 ("early_exits", "exits"), ("cache_hits", "cache"),
                 ("fallback_steps", "retries"), ("shed", "shed"),
                 ("lost", "lost"), ("policy_fallbacks", "fallbacks"),
                 ("monitor_cpu_overhead", "monitor")])
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.preset != "realtime-chat":
        name = f"{name}_{args.preset}"
    png = RESULTS / f"bench_tidal_{name}.png"
    plot(png, f"{name}: tidal day ({args.day_s:.0f} s), peak {peak:.0f} req/s", (args.day_s, peak / 17),
         timelines, slo)
    path = write_json(f"bench_tidal_{name}", {"model": args.model, "capacity_rps": capacity,
                                              "slo_s": slo, "light_budget": light,
                                              "requests": len(trace), "rows": rows,
                                              "rounds": runs,
                                              "args": vars(args)})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
