"""Ops one decode step dispatches: the artifact's KV-cached decoder (eager regions), without and
with the fused kernels, and with them and stacked projections (q / k / v and gate / up as one
matmul each: what `rbcompile.compile` makes on CUDA), by op.

    python benchmarks/count_ops.py [--layers 30] [--json benchmarks/results/count_ops.json]

Inside a CUDA graph each op that is not a view is still a kernel launch (1-3 us each at decode
sizes), so where a decode step replays eager regions, fewer ops is less GPU time; on CPU this
counts them, it times nothing. The model is a random Llama with SmolLM2-135M's depth (30 layers)
at a tiny width: what a step dispatches depends on the layers, not on the width. Ops are counted
with a `TorchDispatchMode` (an `rbcompile.*` kernel counts as one), views and metadata-only ops
left out.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import OpCounter  # noqa: E402

DEFAULT_JSON = Path(__file__).parent / "results" / "count_ops.json"


def decode_step_ops(layers: int, kernels: bool, stack: bool) -> collections.Counter:
    """The ops of one decode step (after an 8-token prefill) of a random `layers`-deep Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import rbcompile
    from rbcompile.artifact.cache_pool import zeros
    from rbcompile.runtime.engine.kv_cache import step_inputs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    compiled = rbcompile.compile(AutoModelForCausalLM.from_config(config).eval(), kernels=kernels,
                                 stack_projections=stack)
    decoder, shape = compiled.decoder, compiled.decoder.shape
    cache = zeros(2 * shape.layers, (1, shape.kv_heads, 64, shape.head_dim), shape.dtype,
                  shape.device)
    pads = torch.zeros(1, dtype=torch.long)
    prompt = torch.randint(0, config.vocab_size, (1, 8))
    decoder(prompt, *step_inputs(pads, 0, 8, 64), torch.arange(7, 8), cache)
    with OpCounter() as counter:
        decoder(prompt[:, -1:], *step_inputs(pads, 8, 1, 64), torch.arange(0, 1), cache)
    return counter.ops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (default 30)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write counts")
    args = parser.parse_args(argv)
    counts = {}
    for label, kernels, stack in (("unfused", False, False), ("fused", True, False),
                                  ("stacked", True, True)):
        start = time.perf_counter()
        print(f"# compiling a {args.layers}-layer Llama, kernels={kernels}, "
              f"stack_projections={stack} ...", file=sys.stderr, flush=True)
        counts[label] = decode_step_ops(args.layers, kernels, stack)
        print(f"#   counted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    names = sorted(set().union(*counts.values()), key=lambda n: -max(c[n] for c in counts.values()))
    print(f"ops per decode step, {args.layers} layers, eager regions (views not counted); "
          "stacked: fused + stacked projections")
    print(f"{'op':57s}" + "".join(f" {label:>8s}" for label in counts))
    for name in names:
        print(f"{name:57s}" + "".join(f" {c[name]:8d}" for c in counts.values()))
    totals = {label: sum(c.values()) for label, c in counts.items()}
    print(f"{'total':57s}" + "".join(f" {total:8d}" for total in totals.values())
          + f"  ({totals['stacked'] / totals['unfused']:.2f}x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"layers": args.layers, "torch": torch.__version__,
                                     "totals": totals,
                                     "ops": {k: dict(v) for k, v in counts.items()}}, indent=1))


if __name__ == "__main__":
    main()
