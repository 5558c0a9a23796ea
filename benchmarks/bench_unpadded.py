"""Attention without its mask when no row is padded (passes/unpadded_attention.py): an
artifact's full path on real weights and text, called with its all-ones attention mask
(`masked`: the graph's mask, what every call ran before) and with the mask left out
(`unpadded`: SDPA's `is_causal` for a decoder, no mask for an encoder; what `CompiledModel`
now runs when no row is padded), next to eager transformers given the same all-ones mask.

Both rbcompile rows call the generated module directly (no CUDA graphs, no budget), so the only
difference is the attention's mask. Medians of --rounds interleaved rounds (ABBA); parity: the
largest absolute difference of the first output (logits / hidden states) from eager's, and for
a decoder the share of positions whose top-1 token agrees with eager's.

    python benchmarks/bench_unpadded.py [--models smollm2-135m,minilm-l6] [--rounds 5]
        [--threads 2] [--device cpu|cuda] [--json PATH | --json -]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (interleaved_medians, load_with_eager, pin_threads, print_table,  # noqa: E402
                    text_windows, write_json)

# (batch, tokens) per model family: prompts a decoder prefills; batches an encoder embeds
SHAPES = {"decoder": [(1, 128), (1, 512), (1, 1024), (4, 512)],
          "encoder": [(32, 128), (8, 512)]}


def first_output(outputs) -> torch.Tensor:
    values = outputs.values() if isinstance(outputs, dict) else outputs
    return next(iter(values))


def measure(name: str, rounds: int, device: str) -> list[dict]:
    compiled, eager = load_with_eager(name)
    compiled.to(device)
    eager.to(device)
    module, family = compiled.module, compiled.manifest["architecture"]["family"]
    if getattr(module, "UNPADDED", None) is None:
        raise SystemExit(f"{name}: the artifact has no masks to leave out (compiled before "
                         "unpadded_attention, or a mask it does not recognise)")
    gates = [True] * compiled.num_gates
    rows = []
    for batch, seq in SHAPES[family]:
        if seq > compiled.max_positions:
            continue
        ids, mask = (t.to(device) for t in text_windows(compiled.tokenizer, batch, seq))
        contenders = {"eager": lambda: eager(input_ids=ids, attention_mask=mask),
                      "masked": lambda: module(ids, mask, gates),
                      "unpadded": lambda: module(ids, None, gates)}
        with torch.no_grad():
            outputs = {key: first_output(run()).float() for key, run in contenders.items()}
            print(f"{name} {batch} x {seq}", file=sys.stderr)
            times = interleaved_medians(contenders, rounds)
        row = {"model": name, "batch": batch, "tokens": seq,
               **{f"{key}_ms": times[key]["median_ms"] for key in contenders},
               "speedup": times["masked"]["median_ms"] / times["unpadded"]["median_ms"],
               "masked_diff": (outputs["masked"] - outputs["eager"]).abs().max().item(),
               "unpadded_diff": (outputs["unpadded"] - outputs["eager"]).abs().max().item()}
        if family == "decoder":
            row["top1_agreement"] = (outputs["unpadded"].argmax(-1) == outputs["eager"].argmax(-1)
                                     ).float().mean().item()
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,minilm-l6")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="output path; '-' writes none")
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    rows = [row for name in args.models.split(",") for row in measure(name, args.rounds, args.device)]
    print(f"\nbench_unpadded on {args.device} ({torch.__version__}, {args.threads} threads), fp32, "
          f"full path; median ms per call over {args.rounds} rounds")
    print_table([{**row, **{key: f"{row[key]:.1f}" for key in ("eager_ms", "masked_ms", "unpadded_ms")},
                  "speedup": f"{row['speedup']:.2f}x",
                  "masked_diff": f"{row['masked_diff']:.1e}", "unpadded_diff": f"{row['unpadded_diff']:.1e}",
                  "top1_agreement": (f"{row['top1_agreement']:.1%}" if "top1_agreement" in row else "")}
                 for row in rows],
                [("model", "model"), ("batch", "batch"), ("tokens", "tokens"),
                 ("eager_ms", "eager HF"), ("masked_ms", "rbcompile masked"),
                 ("unpadded_ms", "rbcompile unpadded"), ("speedup", "unpadded speedup"),
                 ("masked_diff", "masked max diff"), ("unpadded_diff", "unpadded max diff"),
                 ("top1_agreement", "unpadded top-1 = eager")])
    if args.json != "-":
        print(f"wrote {write_json('bench_unpadded', {'args': vars(args), 'rows': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
