"""What a change of precision costs a decoder, in the quality guard's unit (quality.quality_loss):
the measure behind the default `--max-quality-loss` (rbcompile/artifact/guard.py).

The Hugging Face model in fp32 is the reference; bf16 and fp16 copies of it run the same
held-out windows (the bundled Tempest excerpt, which calibration does not see) and are scored as
a plan is: top-1 agreement with the fp32 tokens, perplexity ratio, and their quality loss.

    python benchmarks/precision_loss.py [--model smollm2-135m] [--windows 4] [--seq 512]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import pin_threads, print_table, write_json  # noqa: E402

from rbcompile.artifact import quality  # noqa: E402
from rbcompile.calibration_data import decoder_windows, load_texts  # noqa: E402
from rbcompile.frontend.curve import DEFAULT_EVAL  # noqa: E402
from rbcompile.artifact.models import load_hf_model, load_tokenizer, resolve_checkpoint  # noqa: E402


def scored(model, batches, references) -> dict:
    parts = []
    with torch.no_grad():
        for (ids, mask), reference in zip(batches, references):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            parts.append(quality.measure("decoder", {"logits": logits}, ids, mask, reference))
    return quality.summarise("decoder", parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    args = parser.parse_args()
    pin_threads(args.threads)
    checkpoint = resolve_checkpoint(args.model)
    ids = decoder_windows(load_tokenizer(checkpoint), load_texts(DEFAULT_EVAL), args.seq, args.windows)
    batches = [(ids[i:i + 1], torch.ones_like(ids[i:i + 1])) for i in range(len(ids))]
    model = load_hf_model(checkpoint)
    with torch.no_grad():
        references = [model(input_ids=i, attention_mask=m, use_cache=False).logits.argmax(-1)
                      for i, m in batches]
    full = scored(model, batches, references)
    rows = [{"dtype": "float32", **full, "quality_loss": 0.0}]
    for name in args.dtypes:
        measured = scored(load_hf_model(checkpoint).to(getattr(torch, name)), batches, references)
        rows.append({"dtype": name, **measured, "quality_loss": quality.quality_loss(measured, full)})
        print(f"  {name} done", file=sys.stderr)
    for row in rows:
        row["perplexity_ratio"] = row["perplexity"] / full["perplexity"]
    print(f"{args.model}, {len(ids)} x {args.seq} tokens of {DEFAULT_EVAL.name}, against fp32:")
    shown = [{"dtype": row["dtype"], "top1_agreement": f"{row['top1_agreement']:.4f}",
              "perplexity": f"{row['perplexity']:.2f}",
              "perplexity_ratio": f"{row['perplexity_ratio']:.4f}",
              "quality_loss": f"{row['quality_loss']:.4f}"} for row in rows]
    print_table(shown, [("dtype", "dtype"), ("top1_agreement", "top-1 agreement"),
                       ("perplexity", "perplexity"), ("perplexity_ratio", "ppl ratio"),
                       ("quality_loss", "quality loss")])
    write_json("precision_loss", {"model": args.model, "windows": len(ids), "seq": args.seq,
                                  "rows": rows})


if __name__ == "__main__":
    main()
