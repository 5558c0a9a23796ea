"""Each fused kernel against its PyTorch reference at realistic shapes (tokens x hidden).

    python benchmarks/bench_kernels.py                       # CUDA if present, else CPU
    python benchmarks/bench_kernels.py --shapes 4096x576 --kernels rms_norm,swiglu
    python benchmarks/bench_kernels.py --interpret --shapes 256x576   # Triton's interpreter on CPU

Contenders per kernel and shape:
- `reference`: the op's plain PyTorch reference, eager (what the op runs on CPU);
- `compiled`:  that reference under torch.compile (inductor), one compile per shape;
- `triton`:    the Triton launcher (the op's CUDA implementation). On CPU only with
  `--interpret`, which times Triton's interpreter (numpy), not a kernel: a correctness aid.

CUDA: triton.testing.do_bench(..., quantiles=[0.5, 0.2, 0.8]) (median, p20, p80 in ms, L2 flushed
between runs). CPU: time.perf_counter over `--rounds` runs after warm-up, same quantiles.
On CUDA each contender also gets an `<impl>+graph` row (unless `--no-graph`):
do_bench_cudagraph, back-to-back calls replayed from one CUDA graph, so no host launch overhead
and no L2 flush (inputs that fit in L2 stay there); its speedup is against `reference+graph`.
Where do_bench's times differ but the graph times agree, the difference is launch overhead.
Decode-like shapes show it best: `--shapes 8x576,8x4096`. `rotary` reads HIDDEN as q's width:
HIDDEN / 64 heads of 64, the [tokens, heads, 64] projection transposed as attention does;
`rotary_pair` that q and a k of a third of its heads (GQA) in one launch; `write_kv` a k and a
v of that k's shape into caches 64 slots longer, at tokens 32 on; `rotary_write_kv` both in one
launch (k rotated into its cache).
`GB/s` = bytes the op must read and write (inputs + outputs, once) / median time: these kernels
are memory-bound, so it is the figure to hold against the device's bandwidth. `speedup` is the
reference's median / the contender's. Rows are appended to `--csv` with device, versions, date.
"""
import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

KERNELS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "swiglu", "gelu_bias",
           "gated_residual", "rotary", "rotary_pair", "write_kv", "rotary_write_kv")
ROTARY_HEAD_DIM = 64  # rotary: q of hidden / 64 heads (SmolLM2-135M: 9, Llama-3.2-1B: 32)
DEFAULT_CSV = Path(__file__).parent / "results" / "bench_kernels.csv"
CSV_FIELDS = ("date", "device", "torch", "triton", "kernel", "tokens", "hidden", "dtype", "impl",
              "median_ms", "p20_ms", "p80_ms", "gb_per_s", "speedup_vs_reference")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x576,4096x384,4096x4096",
                        help="comma-separated TOKENSxHIDDEN (default: %(default)s)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, choices=("cuda", "cpu"))
    parser.add_argument("--interpret", action="store_true",
                        help="CPU: also time the Triton launchers in Triton's interpreter")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile contender")
    parser.add_argument("--no-graph", action="store_true", help="CUDA: skip the CUDA-graph timings")
    parser.add_argument("--rounds", type=int, default=20, help="CPU timing runs (default 20)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="CSV to append to")
    return parser.parse_args(argv)


def make_case(kernel, tokens, hidden, dtype, device):
    """(launcher, reference, args, bytes moved) for `kernel` at tokens x hidden."""
    import torch

    from rbcompile.kernels import (gated_residual, gelu, layer_norm, rms_norm, rotary, rotary_write_kv,
                                   swiglu, write_kv)

    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    x, other, weight, bias = rand(tokens, hidden), rand(tokens, hidden), rand(hidden), rand(hidden)
    act = x.element_size() * tokens * hidden  # one activation tensor
    param = x.element_size() * hidden
    if kernel == "rms_norm":
        return rms_norm.rms_norm_triton, rms_norm.rms_norm_reference, (x, weight, 1e-6), 2 * act + param
    if kernel == "add_rms_norm":
        return (rms_norm.add_rms_norm_triton, rms_norm.add_rms_norm_reference,
                (x, other, weight, 1e-6), 4 * act + param)
    if kernel == "layer_norm":
        return (layer_norm.layer_norm_triton, layer_norm.layer_norm_reference,
                (x, weight, bias, 1e-5), 2 * act + 2 * param)
    if kernel == "add_layer_norm":
        return (layer_norm.add_layer_norm_triton, layer_norm.add_layer_norm_reference,
                (x, other, weight, bias, 1e-5), 4 * act + 2 * param)
    if kernel == "swiglu":
        return swiglu.swiglu_triton, swiglu.swiglu_reference, (x, other), 3 * act
    if kernel == "gelu_bias":
        return gelu.gelu_bias_triton, gelu.gelu_bias_reference, (x, bias, "tanh"), 2 * act + param
    if kernel == "gated_residual":  # per-row gates: half the rows take the branch
        gate = (torch.arange(tokens, device=device) % 2).to(dtype)
        return (gated_residual.gated_residual_triton, gated_residual.gated_residual_reference,
                (x, other, gate), 3 * act + gate.element_size() * tokens)
    # rotary kernels: q as attention makes it ([1, tokens, heads, 64] transposed), k / v with a
    # third of its heads (GQA), caches 64 slots longer written at tokens 32 on
    heads = max(1, hidden // ROTARY_HEAD_DIM)
    kv_heads = max(1, heads // 3)
    q = rand(1, tokens, heads, ROTARY_HEAD_DIM).transpose(1, 2)
    k, v = (rand(1, tokens, kv_heads, ROTARY_HEAD_DIM).transpose(1, 2) for _ in range(2))
    cos, sin = rand(1, 1, tokens, ROTARY_HEAD_DIM), rand(1, 1, tokens, ROTARY_HEAD_DIM)
    caches = [rand(1, kv_heads, tokens + 64, ROTARY_HEAD_DIM) for _ in range(2)]
    positions = torch.arange(32, 32 + tokens, device=device)
    angles = 2 * cos.numel() * cos.element_size()
    q_bytes, kv_bytes = q.numel() * q.element_size(), k.numel() * k.element_size()
    slots = positions.numel() * positions.element_size()
    if kernel == "rotary":
        return rotary.rotary_triton, rotary.rotary_reference, (q, cos, sin), 2 * q_bytes + angles
    if kernel == "rotary_pair":
        return (rotary.rotary_pair_triton, rotary.rotary_pair_reference, (q, k, cos, sin),
                2 * (q_bytes + kv_bytes) + angles)
    if kernel == "write_kv":  # k as the rotary leaves it (contiguous), v transposed
        return (write_kv.write_kv_triton, write_kv.write_kv_reference,
                (*caches, positions, k.contiguous(), v), 4 * kv_bytes + slots)
    if kernel == "rotary_write_kv":
        return (rotary_write_kv.rotary_write_kv_triton, rotary_write_kv.rotary_write_kv_reference,
                (*caches, positions, q, k, v, cos, sin), 2 * q_bytes + 4 * kv_bytes + angles + slots)
    raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")


def quantiles_ms(fn, device, rounds):
    """(median, p20, p80) in milliseconds."""
    if device == "cuda":
        import triton.testing
        return tuple(triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]))
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - start))
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), deciles[1], deciles[7]


def graph_quantiles_ms(fn):
    """(median, p20, p80) in ms per call of `fn` replayed from a CUDA graph."""
    import triton.testing
    return tuple(triton.testing.do_bench_cudagraph(fn, rep=10, quantiles=[0.5, 0.2, 0.8]))


def device_name(device):
    import torch
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def main(argv=None):
    args = parse_args(argv)
    if args.interpret:  # before anything imports triton: triton.jit reads it per kernel
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from rbcompile.kernels import _triton

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if device == "cuda" and _triton.interpreting():
        raise SystemExit("TRITON_INTERPRET is set: unset it to time the compiled kernels on CUDA")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    run_triton = _triton.AVAILABLE and (device == "cuda" or args.interpret)
    shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes.split(",") if s]
    kernels = [k for k in args.kernels.split(",") if k]
    stamp = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
             "device": device_name(device), "torch": torch.__version__,
             "triton": _triton.triton.__version__ if _triton.AVAILABLE else "none"}
    print(f"# {stamp['device']}, torch {stamp['torch']}, triton {stamp['triton']}, {dtype}, "
          f"{'do_bench' if device == 'cuda' else f'perf_counter x{args.rounds}'}"
          + (", triton = interpreter" if device == "cpu" and run_triton else "")
          + ("" if run_triton else ", triton skipped (CPU; --interpret to run the interpreter)"))
    print("# ms: median [p20, p80]; GB/s: inputs + outputs once / median; speedup: reference / impl")

    args.csv.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens, hidden in shapes:
        for kernel in kernels:
            written = len(rows)
            launcher, reference, inputs, nbytes = make_case(kernel, tokens, hidden, dtype, device)
            contenders = {"reference": reference}
            if not args.no_compile:
                torch._dynamo.reset()
                contenders["compiled"] = torch.compile(reference, dynamic=False)
            if run_triton:
                contenders["triton"] = launcher
            timings = {}
            for impl, fn in contenders.items():
                rounds = max(3, args.rounds // 5) if impl == "triton" and device == "cpu" else args.rounds
                with torch.no_grad():
                    timings[impl] = quantiles_ms(lambda fn=fn: fn(*inputs), device, rounds)
            if device == "cuda" and not args.no_graph:
                for impl, fn in contenders.items():
                    try:
                        with torch.no_grad():
                            timings[f"{impl}+graph"] = graph_quantiles_ms(lambda fn=fn: fn(*inputs))
                    except RuntimeError as error:  # not capturable: no graph rows for this shape
                        print(f"# {kernel} {tokens}x{hidden} {impl}: no CUDA graph "
                              f"({str(error).splitlines()[0]})", flush=True)
                        timings = {k: v for k, v in timings.items() if not k.endswith("+graph")}
                        break
            for impl, (median, p20, p80) in timings.items():
                base = timings["reference+graph" if impl.endswith("+graph") else "reference"][0]
                rows.append({**stamp, "kernel": kernel, "tokens": tokens, "hidden": hidden,
                             "dtype": str(dtype).removeprefix("torch."), "impl": impl,
                             "median_ms": f"{median:.4f}", "p20_ms": f"{p20:.4f}",
                             "p80_ms": f"{p80:.4f}", "gb_per_s": f"{nbytes / median / 1e6:.1f}",
                             "speedup_vs_reference": f"{base / median:.2f}"})
                row = rows[-1]
                print(f"{kernel:15s} {tokens:>5d}x{hidden:<5d} {impl:15s} {median:9.4f} ms "
                      f"[{p20:.4f}, {p80:.4f}]  {row['gb_per_s']:>7s} GB/s  "
                      f"x{row['speedup_vs_reference']}", flush=True)
            append_csv(args.csv, rows[written:])  # per shape: a run cut short keeps its rows
    print(f"# {len(rows)} rows appended to {args.csv}", file=sys.stderr)


def append_csv(path: Path, rows: list[dict]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
