"""Time to first token with prompts prefilled at int8 (activations quantized per token,
smoothed; kernels/token_int8.py) against fp32, through the engine (`model.generate`), with the
quality of what follows next to it (issue 45: a 512-token prefill >= 1.5x faster than fp32).

For each prompt length, --prompts windows of Macbeth (shared data, else the bundled Tempest
excerpt: text the compile never calibrated on) are generated greedily at each contender, the
contenders interleaved per prompt (ABBA); reported: medians of time to first token and its
ratio, and against the fp32 prefill's generation of --new-tokens tokens: the first token equal,
the whole continuation equal, and the tokens equal before the first difference. Decoding is
fp32 in both, so every difference is the prefill's.

    python benchmarks/bench_prefill_precision.py --artifact build/smollm2-135m
        [--lengths 128 512 1024] [--prompts 4] [--new-tokens 32] [--rounds 3] [--threads 2]
        [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import DATA, load_executed, print_table, write_json  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CONTENDERS = ("fp32", "int8")


def prompts(tokenizer, length: int, count: int) -> list[torch.Tensor]:
    """`count` consecutive windows of `length` tokens of Macbeth (or the Tempest excerpt)."""
    source = SHARED / "shakespeare-macbeth.txt"
    text = (source if source.exists() else DATA / "tempest-excerpt.txt").read_text()
    ids = torch.tensor(tokenizer(text).input_ids)
    if len(ids) < length * count:
        raise SystemExit(f"the text has {len(ids)} tokens, need {length * count}")
    return [ids[i * length:(i + 1) * length][None] for i in range(count)]


def first_token_and_tokens(model, prompt: torch.Tensor, prefill: str, new_tokens: int):
    """(seconds to the first token, the greedy tokens) with prompts prefilled at `prefill`."""
    model.use_executor("onnxruntime", "fp32", threads=torch.get_num_threads(), prefill=prefill)
    start, first, tokens = time.perf_counter(), None, []
    for _, token in model.generate(prompt, torch.ones_like(prompt), max_new_tokens=new_tokens,
                                   stream=True):
        first = first or time.perf_counter() - start
        tokens.append(int(token))
    return first, tokens


def agreement(reference: list[int], tokens: list[int]) -> int:
    """How many tokens `tokens` shares with `reference` before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b),
                min(len(reference), len(tokens)))


def measure(model, length: int, args) -> dict:
    windows = prompts(model.tokenizer, length, args.prompts)
    times = {name: [] for name in CONTENDERS}
    outputs: dict[str, list] = {name: [] for name in CONTENDERS}
    first_token_and_tokens(model, windows[0], "int8", 2)   # sessions built
    first_token_and_tokens(model, windows[0], "fp32", 2)
    for round_index in range(args.rounds):
        for index, prompt in enumerate(windows):
            order = CONTENDERS if (round_index + index) % 2 == 0 else CONTENDERS[::-1]
            for name in order:
                seconds, tokens = first_token_and_tokens(model, prompt, name, args.new_tokens)
                times[name].append(seconds)
                if round_index == 0:
                    outputs[name].append(tokens)
    ttft = {name: statistics.median(values) for name, values in times.items()}
    pairs = list(zip(outputs["fp32"], outputs["int8"]))
    return {"prompt_tokens": length, "ttft_fp32_s": ttft["fp32"], "ttft_int8_s": ttft["int8"],
            "speedup": ttft["fp32"] / ttft["int8"],
            "first_token_equal": sum(a[0] == b[0] for a, b in pairs) / len(pairs),
            "continuations_equal": sum(a == b for a, b in pairs) / len(pairs),
            "tokens_before_difference": statistics.median(agreement(a, b) for a, b in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = load_executed(args.artifact, args.threads)
    from rbcompile.artifact.executors import stored_prefills
    stored = stored_prefills(model.manifest).get("int8")
    if stored is None:
        raise SystemExit(f"{args.artifact} has no int8 prefill measured: compile it again")
    rows = []
    for length in args.lengths:
        print(f"{length}-token prompts ...", file=sys.stderr)
        rows.append(measure(model, length, args))
    print(f"\nprompts prefilled at int8 against fp32, decoding fp32, {args.threads} threads, "
          f"{args.prompts} prompts x {args.rounds} rounds; compile measured quality loss "
          f"{stored.losses['fp32']:.3f} (top-1 agreement "
          f"{stored.heldout['top1_agreement']:.3f}) on held-out text")
    print_table([{**row, "ttft_fp32_s": f"{row['ttft_fp32_s']:.3f}",
                  "ttft_int8_s": f"{row['ttft_int8_s']:.3f}", "speedup": f"{row['speedup']:.2f}x",
                  "first_token_equal": f"{row['first_token_equal']:.0%}",
                  "continuations_equal": f"{row['continuations_equal']:.0%}"} for row in rows],
                [("prompt_tokens", "prompt"), ("ttft_fp32_s", "TTFT fp32 s"),
                 ("ttft_int8_s", "TTFT int8 s"), ("speedup", "speedup"),
                 ("first_token_equal", "1st token equal"),
                 ("continuations_equal", f"{args.new_tokens} tokens equal"),
                 ("tokens_before_difference", "equal before 1st diff")])
    path = write_json("bench_prefill_precision", {
        "args": vars(args), "compile_measured": stored.to_json(), "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
