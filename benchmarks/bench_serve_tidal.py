"""The tidal day over HTTP (issue 16): `rbcompile serve` under a day of traffic whose arrival
rate swings 17x (night to peak and back, a raised cosine), compressed into --day-s seconds, with
the static, PID and PPO policies behind the endpoint.

First the full path's capacity is measured in closed loop (--capacity-streams streams for
--capacity-s seconds on a `--policy static` server: completed requests per second, and the
decode-step latency, the gap between streamed chunks). The peak rate is --peak-load x that
capacity, the night rate 1/17 of the peak; arrivals are a seeded Poisson process (thinning), each
a streamed greedy completion of a continuation prompt (--new-tokens), its QoS class drawn
30% interactive / 50% standard / 20% batch. Every contender replays the same trace on a fresh
server (continuous batching, serve's defaults otherwise):
  static-full   --policy static (budget 0: the full path for everything)
  pid           --policy pid --slo-ms (default: the PPO policy's per-step SLO with --ppo, else
                1.5x the decode-step p50 measured at capacity)
  ppo           --policy ppo --policy-file DIR --slo-ms (the per-step SLO it was trained for,
                from its policy.json: serve normalises the latencies the policy sees by it);
                only with --ppo DIR, from `rbcompile train-policy` on a decoder
Reported per contender: requests sent, served, shed (HTTP 503, the watermarks or the queue),
lost (anything else: an error, or a stream that did not finish), throughput (served requests /
s over the day), end-to-end latency p50 / p99, TTFT p99, decode-step latency p99 (chunk gaps),
the mean budget the controller set and the share of the day it had lowered the weight
precision (/metrics sampled every second, runtime/control/levers.py), the controller decisions
the quality guard withheld and the top-1 agreement of its sampled checks (/metrics at the end of
the day), and quality against the full path: the share of requests whose text equals
static-full's, and the mean share of static-full's tokens that match position by position.
The adaptive contenders serve with --max-quality-loss (default: serve's) and, with
--allow-unmeasured-plans, may run unmeasured plans.

    python benchmarks/bench_serve_tidal.py --artifact build/smollm2-135m [--day-s 120]
        [--peak-load 1.2] [--new-tokens 32] [--ppo DIR] [--max-quality-loss L]
        [--allow-unmeasured-plans] [--json PATH] [--smoke]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import _uptime, continuation_prompt  # noqa: E402
from bench_serve import Endpoint, percentile, read_metrics, server  # noqa: E402
from common import RESULTS, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402
from rbcompile.runtime.control.admission import QOS_CLASSES  # noqa: E402

QOS_SHARES = (0.3, 0.5, 0.2)
SWING = 17.0
FULL = "static-full"


def rate_at(t: float, day_s: float, peak: float) -> float:
    """Arrivals per second at `t`: the night rate at 0 and `day_s`, the peak at midday."""
    night = peak / SWING
    return night + (peak - night) * 0.5 * (1 - math.cos(2 * math.pi * t / day_s))


def day_trace(day_s: float, peak: float, seed: int) -> list[tuple[float, str]]:
    """(arrival second, QoS class) of a Poisson process with rate `rate_at` (thinning)."""
    rng, t, trace = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= day_s:
            return trace
        if rng.random() < rate_at(t, day_s, peak) / peak:
            trace.append((t, rng.choices(QOS_CLASSES, QOS_SHARES)[0]))


def policy_slo_ms(folder: str) -> float:
    """The per-step SLO a `train-policy` folder was trained for (its policy.json)."""
    meta = json.loads((Path(folder) / "policy.json").read_text())
    if meta.get("simulator") != "decode-step":
        sys.exit(f"{folder}: not trained in the decode-step simulator (train-policy on a "
                 "decoder, --simulator decode-step)")
    return 1e3 * meta["state"]["slo_s"]


def gaps(records: list[dict]) -> list[float]:
    return [b - a for r in records for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]


async def capacity(endpoint: Endpoint, prompts: list[str], streams: int, seconds: float,
                   new_tokens: int) -> tuple[float, float]:
    """(completed requests per second, decode-step latency p50) in closed loop."""
    records, index, stop_at = [], iter(range(10**9)), time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < stop_at:
            records.append(await endpoint.request(prompts[next(index) % len(prompts)], new_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    done = [r for r in records if not r["error"]]
    return len(done) / (time.perf_counter() - start), statistics.median(gaps(done))


@dataclass
class Day:
    """One contender's day: the records in trace order, the budget gauge sampled every
    second, and /metrics at the end."""
    records: list[dict]
    budgets: list[float]
    metrics: dict[str, float]
    lowered: list[bool]   # per sample: the controller had lowered the weight precision


async def replay(endpoint: Endpoint, trace, prompts: list[str], new_tokens: int) -> Day:
    """Every request of the trace at its second (QoS in the rbcompile object)."""
    start, budgets, lowered = time.perf_counter(), [], []

    async def one(index, at, qos):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await endpoint.request(prompts[index % len(prompts)], new_tokens,
                                      rbcompile={"qos": qos})

    async def sample_budget():
        while True:
            with contextlib.suppress(OSError):
                metrics = read_metrics(endpoint.base_url)
                budgets.append(metrics.get("rbcompile_decode_budget", 0.0))
                lowered.append(metrics.get("rbcompile_decode_weights_quality_loss", 0.0) > 0)
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample_budget())
    try:
        records = await asyncio.gather(*(one(i, at, qos) for i, (at, qos) in enumerate(trace)))
    finally:
        sampler.cancel()
    return Day(records, budgets, read_metrics(endpoint.base_url), lowered)


def agreement(records: list[dict], reference: list[dict], tokenizer) -> tuple[float, float]:
    """(share of texts equal to the reference's, mean share of the reference's tokens matched
    position by position), over requests both served."""
    pairs = [(r["text"], f["text"]) for r, f in zip(records, reference)
             if not r["error"] and not f["error"]]
    if not pairs:
        return math.nan, math.nan
    same = sum(a == b for a, b in pairs) / len(pairs)
    matched = []
    for text, full in pairs:
        a = tokenizer(text, add_special_tokens=False)["input_ids"]
        b = tokenizer(full, add_special_tokens=False)["input_ids"]
        matched.append(sum(x == y for x, y in zip(a, b)) / max(len(b), 1))
    return same, sum(matched) / len(matched)


def summarise(name: str, day: Day, day_s: float, reference: list[dict] | None,
              tokenizer) -> dict:
    records, budgets, metrics = day.records, day.budgets, day.metrics
    served = [r for r in records if not r["error"]]
    shed = sum(r["status"] == 503 for r in records)
    latencies = sorted(r["done"] - r["sent"] for r in served)
    ttft = sorted(r["chunk_times"][0] - r["sent"] for r in served if r["chunk_times"])
    same, tokens = agreement(records, reference, tokenizer) if reference else (1.0, 1.0)
    return {"contender": name, "requests": len(records), "served": len(served), "shed": shed,
            "lost": len(records) - len(served) - shed,
            "throughput_rps": len(served) / day_s,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "ttft_p99_s": percentile(ttft, 99), "step_p99_s": percentile(sorted(gaps(served)), 99),
            "mean_budget": statistics.fmean(budgets) if budgets else 0.0,
            "lowered_share": statistics.fmean(day.lowered) if day.lowered else 0.0,
            "withheld": sum(v for k, v in metrics.items()
                            if k.startswith("rbcompile_lossy_plans_withheld_total")),
            "checked_rows": metrics.get("rbcompile_quality_checked_rows_total", 0.0),
            "checked_agreement": metrics.get("rbcompile_quality_sampled_agreement", math.nan),
            "same_text": same, "token_agreement": tokens}


def print_rows(rows: list[dict]) -> None:
    """The contenders' table, then the targets (issue 16: nothing lost; issue 42: the adaptive
    contenders' texts equal the full path's on >= 95% of requests, p99 beside the full path's)."""
    ms = lambda v: "-" if v is None else f"{1e3 * v:.0f}"  # noqa: E731
    print_table([{**row, "throughput_rps": f"{row['throughput_rps']:.2f}",
                  "latency_p50_s": ms(row["latency_p50_s"]), "latency_p99_s": ms(row["latency_p99_s"]),
                  "ttft_p99_s": ms(row["ttft_p99_s"]), "step_p99_s": ms(row["step_p99_s"]),
                  "mean_budget": f"{row['mean_budget']:.2f}", "same_text": f"{row['same_text']:.0%}",
                  "lowered_share": f"{row['lowered_share']:.0%}",
                  "withheld": f"{row['withheld']:.0f}",
                  "checked_agreement": f"{row['checked_agreement']:.1%} of {row['checked_rows']:.0f}",
                  "token_agreement": f"{row['token_agreement']:.0%}"} for row in rows],
                [("contender", "contender"), ("requests", "sent"), ("served", "served"),
                 ("shed", "shed 503"), ("lost", "lost"), ("throughput_rps", "req/s"),
                 ("latency_p50_s", "p50 ms"), ("latency_p99_s", "p99 ms"),
                 ("ttft_p99_s", "TTFT p99"), ("step_p99_s", "step p99"),
                 ("mean_budget", "budget"), ("lowered_share", "lower weights"),
                 ("withheld", "withheld"),
                 ("checked_agreement", "checked agree"), ("same_text", "same text"),
                 ("token_agreement", "tokens agree")])
    lost = sum(row["lost"] for row in rows)
    print(f"Target (issue 16): zero lost admitted requests over the tidal day: "
          f"{'met' if lost == 0 else f'missed ({lost} lost)'}")
    for row in rows[1:]:
        print(f"Target (issue 42): {row['contender']}'s texts equal {FULL}'s on >= 95% of "
              f"requests: {'met' if row['same_text'] >= 0.95 else 'missed'} "
              f"({row['same_text']:.1%}); p99 {ms(row['latency_p99_s'])} ms vs "
              f"{ms(rows[0]['latency_p99_s'])} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", required=True, help="a compiled decoder artifact folder")
    parser.add_argument("--day-s", type=float, default=120.0, help="seconds the day lasts")
    parser.add_argument("--peak-load", type=float, default=1.2,
                        help="peak arrival rate / the full path's measured capacity")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--capacity-streams", type=int, default=8)
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--slo-ms", type=float, help="pid's decode-step objective (default: "
                        "the --ppo policy's, else 1.5x the step p50 measured at capacity)")
    parser.add_argument("--ppo", metavar="DIR", help="add the ppo contender with this policy")
    parser.add_argument("--max-quality-loss", type=float,
                        help="the adaptive contenders' quality guard (default: serve's)")
    parser.add_argument("--allow-unmeasured-plans", action="store_true",
                        help="the adaptive contenders may run unmeasured plans (the live "
                        "agreement checks still bound them)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--json", help="default benchmarks/results/bench_serve_tidal.json")
    parser.add_argument("--smoke", action="store_true", help="a 10 s day, 4 s capacity, 8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.day_s, args.capacity_s, args.new_tokens, args.capacity_streams = 10.0, 4.0, 8, 2
    ppo_slo_ms = policy_slo_ms(args.ppo) if args.ppo else None   # before minutes of work
    pin_threads(args.threads)
    say(f"load average at start: {_uptime()}")
    compiled = rbcompile.load(args.artifact)
    tokenizer = compiled.tokenizer
    prompts = [continuation_prompt(tokenizer, 20_000 + i)["text"] for i in range(64)]
    logs = RESULTS / "bench_serve_logs"
    logs.mkdir(parents=True, exist_ok=True)

    def serve(name, extra):
        return server(name, args.artifact, extra, args.threads, logs, args.startup_timeout)

    async def measure_capacity(base):
        endpoint = Endpoint(*base)
        await endpoint.setup()
        try:
            await endpoint.request(prompts[-1], 8)   # warm-up
            return await capacity(endpoint, prompts, args.capacity_streams, args.capacity_s,
                                  args.new_tokens)
        finally:
            await endpoint.close()

    with step(f"measuring the full path's capacity ({args.capacity_streams} streams, "
              f"{args.capacity_s:.0f} s closed loop)"), serve("capacity", []) as base:
        full_rps, step_p50 = asyncio.run(measure_capacity(base))
    peak = args.peak_load * full_rps
    slo_ms = args.slo_ms or ppo_slo_ms or 1.5e3 * step_p50
    trace = day_trace(args.day_s, peak, args.seed)
    say(f"  capacity {full_rps:.2f} req/s, decode step p50 {1e3 * step_p50:.0f} ms; peak "
        f"{peak:.2f} req/s, night {peak / SWING:.2f}; {len(trace)} requests over "
        f"{args.day_s:.0f} s; pid SLO {slo_ms:.0f} ms"
        + (f", ppo SLO {ppo_slo_ms:.0f} ms" if args.ppo else ""))

    contenders = {FULL: ["--policy", "static"], "pid": ["--policy", "pid", "--slo-ms", f"{slo_ms:.1f}"]}
    if args.ppo:
        contenders["ppo"] = ["--policy", "ppo", "--policy-file", args.ppo,
                             "--slo-ms", f"{ppo_slo_ms:.1f}"]
    for name in contenders.keys() - {FULL}:
        if args.max_quality_loss is not None:
            contenders[name] += ["--max-quality-loss", f"{args.max_quality_loss:g}"]
        if args.allow_unmeasured_plans:
            contenders[name].append("--allow-unmeasured-plans")

    async def day(base):
        endpoint = Endpoint(*base)
        await endpoint.setup()
        try:
            await endpoint.request(prompts[-1], 8)
            return await replay(endpoint, trace, prompts, args.new_tokens)
        finally:
            await endpoint.close()

    results = {}
    for name, extra in contenders.items():
        with step(f"{name}: replaying the day ({len(trace)} requests)"), serve(name, extra) as base:
            results[name] = asyncio.run(day(base))
    rows = [summarise(name, result, args.day_s,
                      None if name == FULL else results[FULL].records, tokenizer)
            for name, result in results.items()]

    print(f"\nTidal day over HTTP: {len(trace)} requests in {args.day_s:.0f} s, arrival rate "
          f"{peak / SWING:.2f} -> {peak:.2f} -> {peak / SWING:.2f} req/s ({args.peak_load}x the "
          f"full path's {full_rps:.2f} req/s); {args.new_tokens} new tokens each; quality is "
          f"agreement with {FULL}'s greedy text")
    print_rows(rows)
    say(f"load average at end: {_uptime()}")
    path = write_json("bench_serve_tidal", {"args": vars(args), "capacity_rps": full_rps, "step_p50_s": step_p50,
                      "slo_ms": slo_ms, "ppo_slo_ms": ppo_slo_ms, "peak_rps": peak, "trace": trace,
                      "summary": rows,
                      "records": {name: result.records for name, result in results.items()},
                      "budgets": {name: result.budgets for name, result in results.items()}},
                      args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
