"""Drafting under load: the continuous-batching engine in-process, C client streams at once
(each sends --requests-per-stream requests back to back), every request with the same
`speculate` mode, per stream count and mode, interleaved (ABBA over modes per level):
  tokens/s   new tokens of the level's requests / wall time of the level
  ITL p99    gaps between a request's consecutive accepted tokens, p99 over the level's gaps
Prompts are bench_generate's continuation (literature) and technical (vim manual) prompts,
alternating, the same for every mode; greedy tokens are checked equal across modes (every
drafter is lossless). The engine is `Model.batch_engine` with the artifact's drafters (quant
needs the onnxruntime executor and the artifact's measured levels).

    python benchmarks/bench_drafting_load.py --artifact build/smollm2-135m
        [--streams 1 2 4 8 16] [--modes off ngram quant auto] [--requests-per-stream 2]
        [--new-tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import continuation_prompt, technical_prompt  # noqa: E402
from common import load_executed, print_table, write_json  # noqa: E402

from rbcompile.runtime.engine.core import EngineRequest  # noqa: E402


def prompts(tokenizer, count: int, level: int) -> list[list[int]]:
    """`count` prompts of their own for a level, continuation and technical in turn."""
    made = [(continuation_prompt if i % 2 == 0 else technical_prompt)(tokenizer, 100 * level + i)
            for i in range(count)]
    return [tokenizer(prompt["text"])["input_ids"] for prompt in made]


def serve_level(model, work: list[list[list[int]]], mode: str, new_tokens: int) -> dict:
    """Each stream's prompts sent back to back through one engine; tokens, gaps, texts."""
    engine = model.batch_engine(max_batch=max(16, len(work)))
    gaps, texts = [], {}
    queues = [list(enumerate(stream)) for stream in work]

    def send(stream: int) -> None:
        if not queues[stream]:
            return
        index, prompt = queues[stream].pop(0)
        last = [None]

        def on_token(token: int) -> None:
            now = time.perf_counter()
            if last[0] is not None:
                gaps.append(now - last[0])
            last[0] = now

        def on_finish(request: EngineRequest) -> None:
            texts[(stream, index)] = list(request.tokens)
            send(stream)
        engine.submit(EngineRequest(prompt, new_tokens, speculate=mode, on_token=on_token,
                                    on_finish=on_finish))

    started = time.perf_counter()
    for stream in range(len(work)):
        send(stream)
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - started
    tokens = sum(len(row) for row in texts.values())
    return {"tokens_per_second": tokens / wall, "itl_p99_ms": 1e3 * _p99(gaps),
            "tokens": tokens, "wall_s": wall, "texts": texts}


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="build/smollm2-135m")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["off", "ngram", "quant", "auto"])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = load_executed(args.artifact, args.threads)
    serve_level(model, [prompts(model.tokenizer, 2, 99)] * 2, args.modes[-1], 8)   # warm-up
    rows = []
    for level, streams in enumerate(args.streams):
        flat = prompts(model.tokenizer, streams * args.requests_per_stream, level)
        work = [flat[s::streams] for s in range(streams)]
        order = args.modes if level % 2 == 0 else args.modes[::-1]
        results = {mode: serve_level(model, work, mode, args.new_tokens) for mode in order}
        base = results[args.modes[0]]
        for mode in args.modes:
            result = results[mode]
            rows.append({"streams": streams, "mode": mode,
                         "tokens_per_second": round(result["tokens_per_second"], 1),
                         "vs_first": round(result["tokens_per_second"]
                                           / base["tokens_per_second"], 2),
                         "itl_p99_ms": round(result["itl_p99_ms"], 1),
                         "same_tokens": result["texts"] == base["texts"]})
        print(f"  {streams} streams done", file=sys.stderr)
    print(f"in-process engine, {args.threads} threads, {args.requests_per_stream} requests per "
          f"stream, {args.new_tokens} new tokens max, greedy; vs = tokens/s against "
          f"{args.modes[0]}")
    print_table(rows, [("streams", "streams"), ("mode", "speculate"),
                       ("tokens_per_second", "tok/s"), ("vs_first", "vs"),
                       ("itl_p99_ms", "ITL p99 ms"), ("same_tokens", "same tokens")])
    path = write_json("bench_drafting_load", {"artifact": args.artifact, "args": vars(args),
                                              "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
