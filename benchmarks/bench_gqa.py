"""Attention over grouped K/V heads in its three exact forms (rbcompile/artifact/attention.py): K/V
repeated per query head (transformers' `repeat_kv` copies, then SDPA), SDPA's own grouped heads
(`enable_gqa=True`), and the group's queries folded onto their K/V head (`[B, KV*G, Q, D]` as
`[B, KV, G*Q, D]`, the mask shared by the group; not for a causal call), and which form
`grouped_attention` takes for the call on this device.

Two kinds of attention: with the additive mask every rbcompile attention has ("padded"), and
causal without a mask ("causal": a forward without padding, passes/unpadded_attention.py), on
SmolLM2-135M's heads (9 query heads on 3 K/V heads, 64 wide) at decode (1 query), verify (5
queries: a speculative step) and prefill shapes, and a Llama-3.2-1B's (32 on 8) at decode and
at its 4 x 1024 prefill; medians of about --runs timed calls (synchronised on CUDA), the forms
alternating. CPU here; CUDA in benchmarks/gpu_check.sh (bf16), where the rows check the
runtime's choice there: folding for decode and verify steps, the copies for a padded prefill
and for a causal one; the causal rows tell whether it should take flash attention's grouped
heads (`enable_gqa`) there instead.

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

sys.path.insert(0, str(Path(__file__).parent))
from common import pin_threads, print_table, write_json  # noqa: E402

from rbcompile.artifact.attention import FORMS, form  # noqa: E402

HEAD_DIM = 64
SMOLLM2, LLAMA_1B = (9, 3), (32, 8)   # (query heads, K/V heads)
SHAPES = [  # (kind, attention, heads, batch, queries, keys)
    ("decode", "padded", SMOLLM2, 1, 1, 512), ("decode", "padded", SMOLLM2, 8, 1, 512),
    ("verify", "padded", SMOLLM2, 1, 5, 512), ("decode", "padded", LLAMA_1B, 8, 1, 2048),
    ("prefill", "padded", SMOLLM2, 1, 128, 128), ("prefill", "padded", SMOLLM2, 4, 512, 512),
    ("prefill", "causal", SMOLLM2, 4, 512, 512), ("prefill", "padded", LLAMA_1B, 4, 1024, 1024),
    ("prefill", "causal", LLAMA_1B, 4, 1024, 1024)]


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
        def tensor(*sizes):
            return torch.randn(*sizes, HEAD_DIM, generator=generator).to(device, dtype)
        # the queries as their projection leaves them ([B, Q, H, D] seen as [B, H, Q, D])
        query = tensor(batch, queries, heads).transpose(1, 2)
        key, value = tensor(batch, kv_heads, keys), tensor(batch, kv_heads, keys)
        mask, causal = None, attention == "causal"
        if not causal:
            mask = torch.zeros(batch, 1, queries, keys, device=device, dtype=dtype)
            mask[..., :5] = float("-inf")  # a left pad
        names = [name for name in FORMS if not (causal and name == "folded")]  # folding: a mask
        forms = {name: (lambda compute=FORMS[name]:
                        compute(query, key, value, mask, 0.0, causal, None)) for name in names}
        reference = forms["copies"]()
        difference = max((forms[name]() - reference).abs().max().item() for name in names)
        samples = {name: [] for name in forms}
        for round_index in range(4):   # forward and reversed rounds, the first of each a warm-up
            for name in (names if round_index % 2 == 0 else names[::-1]):
                times = timed(forms[name], device, args.runs // 4 + 1)
                samples[name] += times[1:] if round_index < 2 else times
        median = {name: 1e6 * statistics.median(samples[name]) for name in names}
        rows.append({"shape": kind, "attention": attention, "heads": f"{heads}/{kv_heads}",
                     "batch": batch, "queries": queries, "keys": keys,
                     **{f"{name}_us": median.get(name) for name in FORMS},
                     "fastest": min(median, key=median.get),
                     "chosen": form(query, key, value, mask, causal),
                     "max_abs_diff": difference})
    print(f"\nbench_gqa on {device} ({torch.__version__}), {args.dtype}, query / K/V heads x "
          f"{HEAD_DIM}; padded: an additive mask, causal: no mask; median us per call; chosen: "
          "the form rbcompile's grouped_attention takes here")
    def microseconds(value):
        return "" if value is None else f"{value:.0f}"

    print_table([{**row, **{f"{name}_us": microseconds(row[f"{name}_us"]) for name in FORMS},
                  "max_abs_diff": f"{row['max_abs_diff']:.1e}"} for row in rows],
                [("shape", "shape"), ("attention", "attention"), ("heads", "heads"),
                 ("batch", "batch"), ("queries", "queries"), ("keys", "keys"),
                 ("copies_us", "repeat_kv + SDPA"), ("enable_gqa_us", "SDPA enable_gqa"),
                 ("folded_us", "folded queries"), ("fastest", "fastest"), ("chosen", "chosen"),
                 ("max_abs_diff", "max abs diff")])
    if args.json != "-":
        print(f"wrote {write_json('bench_gqa', {'args': vars(args), 'rows': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
