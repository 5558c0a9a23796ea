"""Drafting and the controller per concurrency, over HTTP (issue 46, item 4): `rbcompile serve`
streaming greedy completions to C client streams at once, per stream count C and contender:
  off / ngram / quant / auto   one server (--max-batch, the static policy); each request asks
                               its drafter (`rbcompile.speculate`)
  controller                   a second server with `--policy pid --slo-ms` and
                               `--max-quality-loss` (its lever order: runtime/control/levers.py),
                               its requests asking `speculate="auto"`
Each of C streams sends --requests-per-stream requests back to back; a level has prompts of its
own (bench_generate's continuation and technical prompts in turn), the same for every
contender; contenders take turns per level (ABBA over levels). Reported per level and
contender: tokens/s (completion tokens / the level's wall time) and its ratio to `off`, p99
inter-token latency (gaps between streamed chunks: a drafting step streams several tokens as
one chunk), TTFT p50, and the share of requests whose text equals `off`'s (every drafter is
lossless: 100% expected; the controller's lower levels may change texts).

    python benchmarks/bench_serve_drafting.py --artifact build/smollm2-135m
        [--concurrency 1 2 4 8 16 32] [--requests-per-stream 1] [--new-tokens 128]
        [--modes off ngram quant auto] [--slo-ms 100] [--max-quality-loss 0.06] [--smoke]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import continuation_prompt, technical_prompt  # noqa: E402
from bench_serve import (  # noqa: E402
    Endpoint,
    count_tokens,
    drive,
    percentile,
    server,
)
from common import RESULTS, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.progress import say, step  # noqa: E402

CONTROLLER = "controller"


def level_prompts(tokenizer, level: int, count: int) -> list[str]:
    """`count` prompts of a level's own, continuation and technical in turn."""
    return [(continuation_prompt if i % 2 == 0 else technical_prompt)(
        tokenizer, 1000 * level + i)["text"] for i in range(count)]


def row(level: int, name: str, records: list[dict], seconds: float, tokenizer, new_tokens: int,
        baseline: list[dict] | None) -> dict:
    """A level's measures for one contender (texts compared with `baseline`'s, off's)."""
    tokens = sum(count_tokens(r, tokenizer, new_tokens)[0] for r in records)
    ok = [r for r in records if not r["error"]]
    gaps = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    ttft = [r["chunk_times"][0] - r["sent"] for r in ok if r["chunk_times"]]
    same = None if baseline is None else sum(
        a["text"] == b["text"] for a, b in zip(records, baseline)) / len(records)
    return {"streams": level, "contender": name, "requests": len(records),
            "errors": len(records) - len(ok), "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "itl_p99_s": percentile(gaps, 99),
            "ttft_p50_s": percentile(ttft, 50), "same_text_as_off": same}


async def run_levels(endpoints: dict, contenders: list[str], prompts: dict, args,
                     tokenizer) -> list[dict]:
    rows = []
    for turn, (level, texts) in enumerate(prompts.items()):
        order = contenders if turn % 2 == 0 else contenders[::-1]
        measured = {}
        for name in order:
            endpoint = endpoints[CONTROLLER if name == CONTROLLER else "drafting"]
            mode = "auto" if name == CONTROLLER else name
            measured[name] = await drive(endpoint, texts, level, args.new_tokens,
                                         rbcompile={"speculate": mode})
            say(f"  {level} stream(s), {name}: {measured[name][1]:.1f} s")
        baseline = measured["off"][0] if "off" in measured else None
        for name in contenders:
            rows.append(row(level, name, *measured[name], tokenizer, args.new_tokens, baseline))
    return rows


def report(rows: list[dict]) -> None:
    off = {r["streams"]: r["tokens_per_second"] for r in rows if r["contender"] == "off"}
    print_table([{"c": r["streams"], "who": r["contender"],
                  "tps": f"{r['tokens_per_second']:.1f}",
                  "x": f"{r['tokens_per_second'] / off[r['streams']]:.2f}x"
                  if r["streams"] in off else "-",
                  "itl": f"{1e3 * r['itl_p99_s']:.0f}" if r["itl_p99_s"] else "-",
                  "ttft": f"{1e3 * r['ttft_p50_s']:.0f}" if r["ttft_p50_s"] else "-",
                  "same": "-" if r["same_text_as_off"] is None
                  else f"{100 * r['same_text_as_off']:.0f}%", "err": r["errors"]}
                 for r in rows],
                [("c", "streams"), ("who", "contender"), ("tps", "tok/s"), ("x", "x off"),
                 ("itl", "ITL p99 ms"), ("ttft", "TTFT p50 ms"), ("same", "text = off"),
                 ("err", "errors")])
    autos = [r for r in rows if r["contender"] == "auto" and r["streams"] in off]
    if autos:
        worst = min(autos, key=lambda r: r["tokens_per_second"] / off[r["streams"]])
        print(f"auto against off, worst level: {worst['streams']} stream(s), "
              f"{worst['tokens_per_second'] / off[worst['streams']]:.2f}x (target >= 1.0x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="build/smollm2-135m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--modes", nargs="+", default=["off", "ngram", "quant", "auto"],
                        choices=("off", "ngram", "quant", "auto"))
    parser.add_argument("--no-controller", action="store_true", help="leave the pid server out")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="the controller's SLO")
    parser.add_argument("--max-quality-loss", type=float, default=0.06,
                        help="the controller server's quality guard")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--json", help="default benchmarks/results/bench_serve_drafting.json")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 streams, 8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.new_tokens = [1, 2], 8
    pin_threads(args.threads)
    tokenizer = rbcompile.load(args.artifact).tokenizer
    contenders = list(args.modes) + ([] if args.no_controller else [CONTROLLER])
    prompts = {level: level_prompts(tokenizer, level, level * args.requests_per_stream)
               for level in args.concurrency}
    batch = ["--max-batch", str(max(16, max(args.concurrency)))]
    logs = RESULTS / "bench_serve_logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        with step("starting the servers"):
            urls = {"drafting": stack.enter_context(server(
                "drafting", args.artifact, batch, args.threads, logs, args.startup_timeout))}
            if CONTROLLER in contenders:
                urls[CONTROLLER] = stack.enter_context(server(
                    CONTROLLER, args.artifact, batch + [
                        "--policy", "pid", "--slo-ms", str(args.slo_ms),
                        "--max-quality-loss", str(args.max_quality_loss)],
                    args.threads, logs, args.startup_timeout))

        async def session():
            endpoints = {name: Endpoint(*served) for name, served in urls.items()}
            try:
                for endpoint in endpoints.values():
                    await endpoint.setup()
                    for mode in args.modes:   # every drafter's graphs built before timing
                        await drive(endpoint, level_prompts(tokenizer, 0, 2), 2, 8,
                                    rbcompile={"speculate": mode})
                return await run_levels(endpoints, contenders, prompts, args, tokenizer)
            finally:
                for endpoint in endpoints.values():
                    await endpoint.close()

        rows = asyncio.run(session())
    report(rows)
    path = write_json("bench_serve_drafting", {
        "artifact": args.artifact, "new_tokens": args.new_tokens, "threads": args.threads,
        "requests_per_stream": args.requests_per_stream, "slo_ms": args.slo_ms,
        "max_quality_loss": args.max_quality_loss, "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
