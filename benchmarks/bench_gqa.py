"""Attention over grouped K/V heads: transformers' `repeat_kv` copies, then SDPA, against SDPA
with `enable_gqa=True` (what passes/gqa_attention.py makes of the copies off CUDA), with the
additive mask every rbcompile attention has.

SmolLM2-135M's heads (9 query heads on 3 K/V heads, 64 wide), decode (1 query) and prefill
shapes; medians of --runs timed calls (synchronised on CUDA), the two forms alternating. The
pass keeps the copies on CUDA, where the fused kernel that takes a mask does not take grouped
heads: this is the check of both choices (CPU here, CUDA in benchmarks/gpu_check.sh).

    python benchmarks/bench_gqa.py [--device cpu|cuda] [--dtype fp32|bf16] [--runs 50]
        [--threads 2] [--json PATH | --json -]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import pin_threads, print_table, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = [("decode", 1, 1, 512), ("decode", 8, 1, 512), ("prefill", 1, 128, 128),
          ("prefill", 4, 512, 512)]   # (kind, batch, queries, keys)


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    return x[:, :, None].expand(batch, heads, group, length, dim).reshape(
        batch, heads * group, length, dim)


def timed(fn, device, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="output path; '-' writes none")
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for kind, batch, queries, keys in SHAPES:
        def tensor(heads, length):
            return torch.randn(batch, heads, length, HEAD_DIM, generator=generator).to(device, dtype)
        query, key, value = tensor(HEADS, queries), tensor(KV_HEADS, keys), tensor(KV_HEADS, keys)
        mask = torch.zeros(batch, 1, queries, keys, device=device, dtype=dtype)
        mask[..., :5] = float("-inf")  # a left pad
        group = HEADS // KV_HEADS
        forms = {"copies": lambda: F.scaled_dot_product_attention(
                     query, repeat_kv(key, group), repeat_kv(value, group), mask),
                 "enable_gqa": lambda: F.scaled_dot_product_attention(
                     query, key, value, mask, enable_gqa=True)}
        difference = (forms["copies"]() - forms["enable_gqa"]()).abs().max().item()
        samples = {name: [] for name in forms}
        for round_index in range(4):   # ABBA rounds, the first of each form a warm-up
            for name in (list(forms) if round_index % 2 == 0 else list(forms)[::-1]):
                times = timed(forms[name], device, args.runs // 4 + 1)
                samples[name] += times[1:] if round_index < 2 else times
        copies, grouped = (1e6 * statistics.median(samples[name]) for name in forms)
        rows.append({"shape": kind, "batch": batch, "queries": queries, "keys": keys,
                     "copies_us": copies, "enable_gqa_us": grouped, "speedup": copies / grouped,
                     "max_abs_diff": difference})
    print(f"\nbench_gqa on {device} ({torch.__version__}), {args.dtype}, {HEADS} query heads on "
          f"{KV_HEADS} K/V heads x {HEAD_DIM}, additive mask; median us per call")
    print_table([{**row, "copies_us": f"{row['copies_us']:.0f}",
                  "enable_gqa_us": f"{row['enable_gqa_us']:.0f}", "speedup": f"{row['speedup']:.2f}x",
                  "max_abs_diff": f"{row['max_abs_diff']:.1e}"} for row in rows],
                [("shape", "shape"), ("batch", "batch"), ("queries", "queries"), ("keys", "keys"),
                 ("copies_us", "repeat_kv + SDPA"), ("enable_gqa_us", "SDPA enable_gqa"),
                 ("speedup", "enable_gqa speedup"), ("max_abs_diff", "max abs diff")])
    if args.json != "-":
        print(f"wrote {write_json('bench_gqa', {'args': vars(args), 'rows': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
