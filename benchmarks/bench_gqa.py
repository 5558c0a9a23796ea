"""Attention over grouped K/V heads: transformers' `repeat_kv` copies, then SDPA, against SDPA
with `enable_gqa=True` (what passes/gqa_attention.py makes of the copies off CUDA).

Two kinds of attention: with the additive mask every rbcompile attention has ("padded"), and
causal without a mask ("causal": a forward without padding, passes/unpadded_attention.py), on
SmolLM2-135M's heads (9 query heads on 3 K/V heads, 64 wide) at decode (1 query) and prefill
shapes, and a Llama-3.2-1B's (32 on 8) at its 4 x 1024 prefill; medians of --runs timed calls
(synchronised on CUDA), the two forms alternating. The pass keeps the copies on CUDA, where the
fused kernel that takes a mask does not take grouped heads (flash takes them, but no mask): the
padded rows check that choice, the causal ones what reading grouped heads would gain where no
mask is read (CPU here, CUDA in benchmarks/gpu_check.sh).

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

HEAD_DIM = 64
SMOLLM2, LLAMA_1B = (9, 3), (32, 8)   # (query heads, K/V heads)
SHAPES = [  # (kind, attention, heads, batch, queries, keys)
    ("decode", "padded", SMOLLM2, 1, 1, 512), ("decode", "padded", SMOLLM2, 8, 1, 512),
    ("prefill", "padded", SMOLLM2, 1, 128, 128), ("prefill", "padded", SMOLLM2, 4, 512, 512),
    ("prefill", "causal", SMOLLM2, 4, 512, 512), ("prefill", "padded", LLAMA_1B, 4, 1024, 1024),
    ("prefill", "causal", LLAMA_1B, 4, 1024, 1024)]


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
    for kind, attention, (heads, kv_heads), batch, queries, keys in SHAPES:
        def tensor(heads, length):
            return torch.randn(batch, heads, length, HEAD_DIM, generator=generator).to(device, dtype)
        query, key, value = tensor(heads, queries), tensor(kv_heads, keys), tensor(kv_heads, keys)
        mask, causal = None, attention == "causal"
        if not causal:
            mask = torch.zeros(batch, 1, queries, keys, device=device, dtype=dtype)
            mask[..., :5] = float("-inf")  # a left pad
        group = heads // kv_heads
        forms = {"copies": lambda: F.scaled_dot_product_attention(
                     query, repeat_kv(key, group), repeat_kv(value, group), mask, is_causal=causal),
                 "enable_gqa": lambda: F.scaled_dot_product_attention(
                     query, key, value, mask, is_causal=causal, enable_gqa=True)}
        difference = (forms["copies"]() - forms["enable_gqa"]()).abs().max().item()
        samples = {name: [] for name in forms}
        for round_index in range(4):   # ABBA rounds, the first of each form a warm-up
            for name in (list(forms) if round_index % 2 == 0 else list(forms)[::-1]):
                times = timed(forms[name], device, args.runs // 4 + 1)
                samples[name] += times[1:] if round_index < 2 else times
        copies, grouped = (1e6 * statistics.median(samples[name]) for name in forms)
        rows.append({"shape": kind, "attention": attention, "heads": f"{heads}/{kv_heads}",
                     "batch": batch, "queries": queries, "keys": keys,
                     "copies_us": copies, "enable_gqa_us": grouped, "speedup": copies / grouped,
                     "max_abs_diff": difference})
    print(f"\nbench_gqa on {device} ({torch.__version__}), {args.dtype}, query / K/V heads x "
          f"{HEAD_DIM}; padded: an additive mask, causal: no mask; median us per call")
    print_table([{**row, "copies_us": f"{row['copies_us']:.0f}",
                  "enable_gqa_us": f"{row['enable_gqa_us']:.0f}", "speedup": f"{row['speedup']:.2f}x",
                  "max_abs_diff": f"{row['max_abs_diff']:.1e}"} for row in rows],
                [("shape", "shape"), ("attention", "attention"), ("heads", "heads"),
                 ("batch", "batch"), ("queries", "queries"), ("keys", "keys"),
                 ("copies_us", "repeat_kv + SDPA"), ("enable_gqa_us", "SDPA enable_gqa"),
                 ("speedup", "enable_gqa speedup"), ("max_abs_diff", "max abs diff")])
    if args.json != "-":
        print(f"wrote {write_json('bench_gqa', {'args': vars(args), 'rows': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
