"""Host time per decode step (and per forward call): what rbcompile's runtime adds around a
CUDA graph's replay.

Under CUDA graphs a decode step is one replay, and what is left is the host's: choosing the
graph (`GraphCache`), preparing the step's inputs, copying them in, sampling and bookkeeping.
While the host does that the GPU waits (each token needs the one before), so it adds to every
token; a forward call's host work (checking the inputs, padding them to their bucket) adds to
its latency likewise. This script measures it without a GPU: the model runs under a capture
whose replay does nothing (the captured outputs stand for the step's), so each step's time is
the host's alone. It also counts the tensor ops each step runs outside the graph (views
excluded): on a GPU each is a kernel launch or a copy.

Contenders, each at batch 1 and batch 8 (greedy, --new-tokens per row, no EOS):
  generate   `CompiledModel.generate` (a static batch: rbcompile run, the Python API);
  engine     `BatchEngine.step` (continuous batching: what `rbcompile serve` runs);
  forward    `CompiledModel.__call__` on 128-token rows without padding (a prefill's or an
             encoder's forward; a "step" is one call, --new-tokens calls per run);
  backend    transformers' `generate` with a static cache, the model's forward compiled by
             `torch.compile(backend="rbcompile", options={"cuda_graphs": True})` (eager regions):
             a step is the time from one decode forward call to the next, transformers' loop
             included, dynamo's guards too (its ops are not counted: counting them would change
             what dynamo runs);
  hf-loop    the same `generate` with a forward that computes nothing (returns fixed logits):
             transformers' own share of a backend step.
The model is a random Llama with SmolLM2-135M's layer and head counts at a tiny width (the
host's work depends on the layers, not the width). Median per-step time over --rounds runs,
steps before the first replay of a shape left out (they run the model eagerly).
Writes benchmarks/results/bench_host.json (or --json PATH).

    python benchmarks/bench_host.py [--layers 30] [--new-tokens 128] [--rounds 7]
        [--batches 1 8] [--threads 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import OpCounter, pin_threads, print_table, write_json  # noqa: E402

import rbcompile  # noqa: E402
from rbcompile.runtime.engine.core import EngineRequest  # noqa: E402
from rbcompile.progress import say  # noqa: E402


def free_replay(run, static_inputs):
    """A capture whose replay costs nothing: the outputs stay those of the capturing run."""
    return (lambda: None), run(*static_inputs)


def tiny_smollm(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=72, intermediate_size=96,
                         num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def timed_steps(step, graphs) -> tuple[list[float], list[bool]]:
    """Per-step seconds of `step()` until it returns False, and whether each one replayed
    without an eager run."""
    times, replayed = [], []
    while True:
        eager, start = graphs.stats.eager_calls + graphs.stats.captures, time.perf_counter()
        more = step()
        times.append(time.perf_counter() - start)
        replayed.append(graphs.stats.eager_calls + graphs.stats.captures == eager)
        if not more:
            return times, replayed


def generate_steps(compiled, prompts: torch.Tensor, new_tokens: int):
    """A step function over `generate`'s token stream: one call per decode step."""
    events = iter(compiled.generate(prompts, max_new_tokens=new_tokens, stream=True))
    rows = prompts.shape[0]

    def step():
        for _ in range(rows):   # a step emits one token per row
            if next(events, None) is None:
                return False
        return True
    return step


def engine_steps(compiled, prompts: torch.Tensor, new_tokens: int):
    engine = compiled.batch_engine(max_batch=prompts.shape[0])
    for prompt in prompts.tolist():
        engine.submit(EngineRequest(prompt, new_tokens))
    engine.step()   # the prefill (and the first decode step)

    def step():
        engine.step()
        return engine.has_work
    return step


def forward_steps(compiled, prompts: torch.Tensor, new_tokens: int):
    """`new_tokens` calls of the model on the prompts four times over (128 tokens, all-ones
    mask: a prefill's forward, filling its sequence bucket)."""
    ids = prompts.repeat(1, 4)
    mask, calls = torch.ones_like(ids), iter(range(new_tokens - 1))

    def step():
        compiled(ids, mask)
        return next(calls, None) is not None
    return step


# name -> (step maker, the GraphCache its steps replay)
CONTENDERS = {"generate": (generate_steps, lambda compiled: compiled.decoder.graphs),
              "engine": (engine_steps, lambda compiled: compiled.decoder.graphs),
              "forward": (forward_steps, lambda compiled: compiled.cuda_graphs)}


def generate_step_times(model, prompts: torch.Tensor, new_tokens: int, forward) -> list[float]:
    """Seconds from each decode forward call of transformers' `generate` (static cache) to the
    next, with `forward` as the model's forward."""
    starts = []

    def timed(*args, **kwargs):
        starts.append(time.perf_counter())
        return forward(*args, **kwargs)
    model.forward = timed
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                       disable_compile=True)
    return [later - earlier for earlier, later in zip(starts[1:], starts[2:])]


def transformers_rows(args) -> list[dict]:
    """The `backend` and `hf-loop` rows (see the module docstring)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = tiny_smollm(args.layers)
    forward = model.forward
    options = {"regions": "eager", "cuda_graphs": True, "capture": free_replay}
    compiled = torch.compile(forward, backend="rbcompile", options=options)

    def no_model(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        return CausalLMOutputWithPast(logits=torch.zeros(rows, 1, model.config.vocab_size))
    rows = []
    for name, run in (("backend", compiled), ("hf-loop", no_model)):
        for batch in args.batches:
            say(f"{name}, batch {batch} ...")
            prompts = torch.randint(3, 512, (batch, 32), generator=torch.Generator().manual_seed(batch))
            for _ in range(2):   # capture every shape this run meets
                generate_step_times(model, prompts, args.new_tokens, run)
            medians = [statistics.median(generate_step_times(model, prompts, args.new_tokens, run))
                       for _ in range(args.rounds)]
            rows.append({"contender": name, "batch": batch, "host_us": 1e6 * statistics.median(medians),
                         "host_us_min": 1e6 * min(medians)})
    model.forward = forward
    return rows


def measure(compiled, name: str, batch: int, args) -> dict:
    make, graphs_of = CONTENDERS[name]
    graphs = graphs_of(compiled)
    prompts = torch.randint(3, 512, (batch, 32), generator=torch.Generator().manual_seed(batch))
    for _ in range(2):   # capture every shape this run meets
        timed_steps(make(compiled, prompts, args.new_tokens), graphs)
    medians, repeats, replays = [], graphs.stats.repeats, graphs.stats.replays
    for _ in range(args.rounds):
        times, replayed = timed_steps(make(compiled, prompts, args.new_tokens), graphs)
        medians.append(statistics.median(t for t, ok in zip(times, replayed) if ok))
    steady = (graphs.stats.repeats - repeats) / max(1, graphs.stats.replays - replays)
    counter, step = OpCounter(), make(compiled, prompts, args.new_tokens)
    for _ in range(4):
        step()
    eager = graphs.stats.eager_calls + graphs.stats.captures
    with counter:
        for _ in range(16):
            step()
    if graphs.stats.eager_calls + graphs.stats.captures != eager:
        raise RuntimeError(f"{name}: a step ran the model eagerly while its ops were counted")
    return {"contender": name, "batch": batch, "host_us": 1e6 * statistics.median(medians),
            "host_us_min": 1e6 * min(medians), "ops_per_step": sum(counter.ops.values()) / 16,
            "ops": {op: count / 16 for op, count in counter.ops.most_common()},
            "repeat_share": steady}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    pin_threads(args.threads)
    compiled = rbcompile.compile(tiny_smollm(args.layers))
    compiled.use_cuda_graphs(capture=free_replay)
    rows = []
    for name in CONTENDERS:
        for batch in args.batches:
            say(f"{name}, batch {batch} ...")
            rows.append(measure(compiled, name, batch, args))
    rows += transformers_rows(args)
    print(f"\nbench_host: host time per decode step (forward: per call) around a free replay "
          f"({args.layers} layers, {args.new_tokens} new tokens per row, median of {args.rounds} "
          f"runs' medians, {args.threads} thread)")
    print_table([{**row, "host_us": f"{row['host_us']:.0f}", "host_us_min": f"{row['host_us_min']:.0f}",
                  "ops_per_step": f"{row['ops_per_step']:.1f}" if "ops_per_step" in row else "",
                  "repeat_share": f"{100 * row['repeat_share']:.0f}%" if "repeat_share" in row else ""}
                 for row in rows],
                [("contender", "contender"), ("batch", "batch"), ("host_us", "host us/step"),
                 ("host_us_min", "min"), ("ops_per_step", "ops outside the graph"),
                 ("repeat_share", "replays by identity")])
    path = write_json("bench_host", {"args": vars(args), "rows": rows}, args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
