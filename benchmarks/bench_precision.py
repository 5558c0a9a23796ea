"""Linear kernels per weight precision on this CPU (issue 45): SmolLM2-135M's linear shapes at
batch-1 decode (1 row), batch-8 decode (8 rows) and prefill (512 rows), each contender's
median time next to torch fp32 `F.linear` in the same run, with its output's error.

Contenders (all on the same random weight, threads pinned, each timed in a block after a
warm-up, blocks in alternating order):
  torch fp32        F.linear (MKL), what the torch executor runs
  ort fp32          onnxruntime FusedMatMul on the [out, in] weight (the step graph's fp32 linear)
  ort int8          MatMulNBits 8-bit, symmetric blocks of 32 (int8 activations: accuracy level 4)
  ort int4          MatMulNBits 4-bit, asymmetric blocks of 32 plus the block-offset matmul
  fbgemm int8       torch.ao dynamic int8 (per-tensor activations, per-channel weights)
error = max |y - y_fp32| / max |y_fp32|.

    python benchmarks/bench_precision.py [--threads 2] [--repeats 30] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).parent))
from common import pin_threads, print_table, write_json  # noqa: E402

from rbcompile.artifact.ort_threads import session_options  # noqa: E402
from rbcompile.artifact.step_graph import MS_DOMAIN, OPSET, StepShape, StepVariant, _Builder  # noqa: E402
from rbcompile.kernels.int_weights import quantize  # noqa: E402

# (name, in, out): q/k/v stacked, o, gate/up stacked, down, the vocabulary head
SHAPES = (("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072),
          ("down_proj", 1536, 576), ("lm_head", 576, 49152))
ROWS = {"decode b1": 1, "decode b8": 8, "prefill 512": 512}


def _session(weight: torch.Tensor, level: str, threads: int):
    """One linear as the step graph builds it, in its own onnxruntime session."""
    out_features, in_features = weight.shape
    source = {"w": weight.numpy()}
    if level != "fp32":
        source[f"w@{level}"] = quantize(weight, 8 if level == "int8" else 4)
    builder = _Builder(StepShape(1, in_features, 1, 1, 1, 1, 1e-5, 1),
                       StepVariant(precision=(("w", level),) if level != "fp32" else ()),
                       source=source.__getitem__)
    y = builder.linear("x", ["w"], out="y")[0]
    graph = helper.make_graph(
        builder.nodes, "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, in_features])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, None, out_features])],
        builder.constants + [onnx.numpy_helper.from_array(value, name)
                             for name, value in {**builder.initializers, **builder.weight_inputs}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    # idle sessions must not spin: there is one per weight copy (a decoder has one session)
    options = session_options(threads, spinning=False)
    session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"x": x[None].numpy()})[0][0])


def contenders(weight: torch.Tensor, threads: int) -> dict:
    with torch.no_grad():
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.copy_(weight)
        dynamic = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear),
                                                         {torch.nn.Linear}, dtype=torch.qint8)
    return {"torch fp32": lambda x: torch.nn.functional.linear(x, weight),
            **{f"ort {level}": _session(weight, level, threads)
               for level in ("fp32", "int8", "int4")},
            "fbgemm int8": lambda x: dynamic(x)}


def _in_turn(per_copy: list[dict]) -> dict:
    """Contenders that call the next copy's kernel at each call."""
    calls = {"count": 0}

    def contender(name):
        def call(x):
            calls["count"] += 1
            return per_copy[calls["count"] % len(per_copy)][name](x)
        return call
    return {name: contender(name) for name in per_copy[0]}


def measure(fns: dict, x: torch.Tensor, repeats: int, reverse: bool) -> dict[str, list[float]]:
    """Each contender in a block of `repeats` calls after 3 warm-up calls, blocks in turn
    (reversed on alternate shapes). Not interleaved call by call: onnxruntime's idle threads
    spin for a while after a run, taking the cores from torch's next call (a torch fp32
    GEMM of 8 rows measured 50x slower right after an onnxruntime run)."""
    times = {name: [] for name in fns}
    order = list(fns.items())
    with torch.no_grad():
        for name, fn in (order[::-1] if reverse else order):
            for _ in range(3):
                fn(x)
            for _ in range(repeats):
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--copies", type=int, default=30,
                        help="distinct weights per shape, called in turn (30: one per SmolLM2 "
                        "layer, so the block shapes stream from memory as in decoding, not "
                        "from cache; 1: one weight, cache-resident)")
    parser.add_argument("--json", help="default benchmarks/results/bench_precision.json")
    args = parser.parse_args()
    pin_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, in_features, out_features in SHAPES:
        copies = 1 if name == "lm_head" else args.copies  # the head alone is 113 MB
        weights = [torch.randn(out_features, in_features, generator=generator) * 0.05
                   for _ in range(copies)]
        per_copy = [contenders(weight, args.threads) for weight in weights]
        fns = _in_turn(per_copy)
        for phase, count in ROWS.items():
            x = torch.randn(count, in_features, generator=generator)
            with torch.no_grad():
                reference = torch.nn.functional.linear(x, weights[0])
                errors = {key: float((fn(x) - reference).abs().max() / reference.abs().max())
                          for key, fn in per_copy[0].items()}
            times = measure(fns, x, args.repeats, reverse=len(rows) % 2 == 1)
            base = statistics.median(times["torch fp32"])
            for key, samples in times.items():
                median = statistics.median(samples)
                rows.append({"shape": name, "in": in_features, "out": out_features,
                             "copies": copies,
                             "phase": phase, "rows": count, "contender": key,
                             "median_us": median * 1e6, "vs_torch_fp32": base / median,
                             "error": errors[key]})
            print(f"  {name} x{copies} {phase}: " + "  ".join(
                f"{r['contender']} {r['vs_torch_fp32']:.2f}x" for r in rows[-len(fns):]),
                flush=True)
    print(f"\nLinear kernels, {args.threads} threads, median of {args.repeats} calls per "
          "contender; 'speed' = torch fp32 time / contender time (>1: faster).\n")
    print_table([{**r, "median_us": f"{r['median_us']:.0f}", "speed": f"{r['vs_torch_fp32']:.2f}x",
                  "error": f"{r['error']:.1e}"} for r in rows],
                [("shape", "shape"), ("phase", "phase"), ("contender", "contender"),
                 ("median_us", "us"), ("speed", "speed"), ("error", "error")])
    path = write_json("bench_precision", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
