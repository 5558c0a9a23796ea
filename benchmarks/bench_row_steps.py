"""Batched prefill steps on the onnxruntime executor: one step of ROWS rows x T tokens through
the batched plain-ops attention against the same step row by row through the fused
GroupQueryAttention (what `StepExecutor.row_steps_from` chooses between), per T, interleaved.
The cache holds T rounded up to 64 slots, as the engine allocates it.

    python benchmarks/bench_row_steps.py --artifact build/smollm2-135m [--rows 8]
        [--tokens 16 32 64 80 96 128 200] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_medians, load_executed, print_table, write_json  # noqa: E402

from rbcompile.artifact.step_executor import ROW_STEPS_FROM  # noqa: E402


def step(decoder, rows: int, tokens: int, *, row_by_row: bool):
    """A prefill step of `rows` x `tokens` from slot 0, with row steps on or off."""
    shape = decoder.shape
    slots = (tokens // 64 + 1) * 64
    cache = [torch.rand(rows, shape.kv_heads, slots, shape.head_dim)
             for _ in range(2 * shape.layers)]
    ids = torch.randint(100, 1000, (rows, tokens))
    mask = torch.ones(rows, tokens, dtype=torch.long)
    positions = torch.arange(tokens)[None].repeat(rows, 1)

    def run():
        decoder.executor.row_steps_from = 2 if row_by_row else None
        decoder(ids, mask, positions, torch.arange(tokens), torch.tensor([tokens - 1]), cache)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="build/smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 80, 96, 128, 200])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = load_executed(args.artifact, args.threads)
    decoder, table = model.decoder, []
    for tokens in args.tokens:
        times = interleaved_medians(
            {name: step(decoder, args.rows, tokens, row_by_row=name == "row by row")
             for name in ("batched", "row by row")}, args.rounds, warmup=1)
        batched, rows = times["batched"]["median_ms"], times["row by row"]["median_ms"]
        table.append({"tokens": tokens, "batched_ms": round(batched, 1),
                      "row_by_row_ms": round(rows, 1), "speedup": round(batched / rows, 2)})
    print(f"{args.rows} rows, {args.threads} threads, medians of {args.rounds}:")
    print_table(table, [("tokens", "tokens per row"), ("batched_ms", "batched ms"),
                        ("row_by_row_ms", "row by row ms"), ("speedup", "row by row speedup")])
    print(f"the executor runs steps of several rows and >= {ROW_STEPS_FROM} tokens row by row")
    path = write_json("bench_row_steps", {"artifact": args.artifact, "rows": args.rows,
                                          "rounds": args.rounds, "table": table}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
