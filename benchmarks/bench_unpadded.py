"""Attention without its mask when no row is padded (passes/unpadded_attention.py): an
artifact's full path on real weights and text, called with its all-ones attention mask
(`masked`: the graph's mask, what every call ran before) and with the mask left out
(`unpadded`: SDPA's `is_causal` for a decoder, no mask for an encoder; what `CompiledModel`
now runs when no row is padded), next to eager transformers given the same all-ones mask.

Both rbcompile rows call the generated module directly (no CUDA graphs, no budget), so the only
difference is the attention's mask. A decoder also gets `prefill` rows: a generation's prefill
and first token through the KV-cached decoder, from the first slot, with its mask or without
(`unpadded_prefill`), and `engine` rows: each row a request's first token through the
continuous-batching engine (runtime/engine/core.py), idle before them (prompts of one length,
prefilled together; one over 512 tokens in chunks of 512, the first from the first slot), with
or without the mask; both next to transformers' `generate` of one token. Medians of --rounds
interleaved rounds (ABBA); parity: the largest absolute difference of the first output (logits /
hidden states) from eager's, and for a decoder the share of positions (prefill: rows) whose
top-1 token agrees with eager's.

    python benchmarks/bench_unpadded.py [--models smollm2-135m,minilm-l6] [--rounds 5]
        [--kinds forward,prefill,engine] [--threads 2] [--device cpu|cuda] [--json PATH | --json -]
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


def forward_contenders(compiled, eager, ids, mask) -> dict:
    """The full forward: (run, its output as a float tensor) per contender."""
    module, gates = compiled.module, [True] * compiled.num_gates
    return {"eager": lambda: first_output(eager(input_ids=ids, attention_mask=mask)).float(),
            "masked": lambda: first_output(module(ids, mask, gates)).float(),
            "unpadded": lambda: first_output(module(ids, None, gates)).float()}


def hf_first_token(eager, ids, mask):
    return lambda: eager.generate(ids, attention_mask=mask, max_new_tokens=1,
                                  do_sample=False)[:, -1:].cpu()


def prefill_contenders(compiled, eager, ids, mask) -> dict:
    """A generation's prefill and first token: the KV-cached decoder from the first slot, its
    mask given or left out (`unpadded_prefill`); eager is transformers' `generate`."""
    from rbcompile.runtime.engine.generation import generate

    def rbc(unpadded):
        return lambda: torch.tensor(generate(compiled.decoder, ids, mask, max_new_tokens=1,
                                             shape=compiled.decoder.shape,
                                             unpadded_prefill=unpadded).tokens)
    return {"eager": hf_first_token(eager, ids, mask), "masked": rbc(False), "unpadded": rbc(True)}


def engine_contenders(compiled, eager, ids, mask) -> dict:
    """Each row a request's first token through the continuous-batching engine, idle before
    them, its prefills with their mask or without (`unpadded_prefill`); eager is transformers'
    `generate`."""
    from rbcompile.runtime.engine.core import EngineRequest

    def rbc(unpadded):
        engine = compiled.batch_engine(max_batch=len(ids), unpadded_prefill=unpadded)

        def run():
            requests = [engine.submit(EngineRequest(row.tolist(), 1)) for row in ids]
            while engine.has_work:
                engine.step()
            return torch.tensor([request.tokens for request in requests])
        return run
    return {"eager": hf_first_token(eager, ids, mask), "masked": rbc(False), "unpadded": rbc(True)}


KINDS = {"forward": forward_contenders, "prefill": prefill_contenders,
         "engine": engine_contenders}


def measure(name: str, rounds: int, device: str, kinds: list[str]) -> list[dict]:
    compiled, eager = load_with_eager(name)
    compiled.to(device)
    eager.to(device)
    family = compiled.manifest["architecture"]["family"]
    if getattr(compiled.module, "UNPADDED", None) is None:
        raise SystemExit(f"{name}: the artifact has no masks to leave out (compiled before "
                         "unpadded_attention, or a mask it does not recognise)")
    if not (family == "decoder" and compiled.decoder.unpadded_prefill):
        kinds = [kind for kind in kinds if kind == "forward"]  # no KV-cached decoder
    rows = []
    for kind in kinds:
        for batch, seq in SHAPES[family]:
            if seq > compiled.max_positions - (kind != "forward"):  # a prompt leaves a position
                continue
            ids, mask = (t.to(device) for t in text_windows(compiled.tokenizer, batch, seq))
            contenders = KINDS[kind](compiled, eager, ids, mask)
            with torch.no_grad():
                outputs = {key: run() for key, run in contenders.items()}
                print(f"{name} {kind} {batch} x {seq}", file=sys.stderr)
                times = interleaved_medians(contenders, rounds)
            row = {"model": name, "kind": kind, "batch": batch, "tokens": seq,
                   **{f"{key}_ms": times[key]["median_ms"] for key in contenders},
                   "speedup": times["masked"]["median_ms"] / times["unpadded"]["median_ms"]}
            if kind == "forward":
                row.update({f"{key}_diff": (outputs[key] - outputs["eager"]).abs().max().item()
                            for key in ("masked", "unpadded")})
            if family == "decoder":  # top-1 tokens (the first generated token: a prefill's)
                top1 = {key: out.argmax(-1) if out.is_floating_point() else out
                        for key, out in outputs.items()}
                row["top1_agreement"] = (top1["unpadded"] == top1["eager"]).float().mean().item()
            rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,minilm-l6")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="comma-separated calls to time (decoders: all; encoders: forward)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="output path; '-' writes none")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    pin_threads(args.threads)
    rows = [row for name in args.models.split(",")
            for row in measure(name, args.rounds, args.device, kinds)]
    print(f"\nbench_unpadded on {args.device} ({torch.__version__}, {args.threads} threads), fp32, "
          f"full path; median ms per call over {args.rounds} rounds")
    print_table([{**row, **{key: f"{row[key]:.1f}" for key in ("eager_ms", "masked_ms", "unpadded_ms")},
                  "speedup": f"{row['speedup']:.2f}x",
                  **{key: f"{row[key]:.1e}" for key in ("masked_diff", "unpadded_diff") if key in row},
                  "top1_agreement": (f"{row['top1_agreement']:.1%}" if "top1_agreement" in row else "")}
                 for row in rows],
                [("model", "model"), ("kind", "call"), ("batch", "batch"), ("tokens", "tokens"),
                 ("eager_ms", "eager HF"), ("masked_ms", "rbcompile masked"),
                 ("unpadded_ms", "rbcompile unpadded"), ("speedup", "unpadded speedup"),
                 ("masked_diff", "masked max diff"), ("unpadded_diff", "unpadded max diff"),
                 ("top1_agreement", "unpadded top-1 = eager")])
    if args.json != "-":
        print(f"wrote {write_json('bench_unpadded', {'args': vars(args), 'rows': rows}, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
