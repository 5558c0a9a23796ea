"""Sweep the Triton kernels' launch configs on CUDA; write the fastest as configs.py's TABLE.

    python benchmarks/tune_kernels.py --json tuned.json       # every kernel, widths 384..4096
    python benchmarks/tune_kernels.py --kernels layer_norm --widths 576,1000 --json t.json

Per kernel and width, in bf16 at `--tokens` rows (default 4096): every candidate config
(`candidates`: rows per program x warps for the norms, block x warps for the elementwise
kernels) is checked once against the reference, then timed through the real launcher under
configs.override, beside the config the table gives now, the eager reference and the
torch.compile'd reference (dynamic=False, one compile per shape), by the timer `--pick` names:
`graph` (the default) is triton.testing.do_bench_cudagraph (back-to-back calls in one CUDA
graph: no host overhead, and no L2 flush, so inputs that fit in L2 stay there; what a captured
plan sees), `bench` is do_bench (median ms, L2 flushed; warmup 5 ms, rep 20 ms), which at these
sizes measures launch and flush noise more than the kernel. The fastest config and the compiled
reference are also shown with do_bench_cudagraph (`graph`); `wall_us` is the wall time per call of
100 back-to-back calls of the table's config and of the compiled reference: about max(host
overhead, GPU time). Where do_bench differs but the graph times agree, the difference is launch
overhead, not the kernel.

At `--decode-tokens` rows (default 8; 0 skips) the table's and the new config are timed the
same way against the compiled reference (`config` shows them as in the table; the launcher
shrinks them for few rows, see configs.py).

Before timing, `--jobs` spawned processes compile every candidate at both rows counts (one
launch each) into Triton's on-disk cache, so the sweep does not compile ~250 variants one after
another.

Output: the table on stdout, one line per shape; `--json` gets all of configs.TABLE with the
swept entries set to the fastest config (the current one is kept unless the new one is at
least 3% faster), rewritten after each kernel: paste it over TABLE in kernels/configs.py.
About 2 minutes on an H200 with the defaults, mostly torch.compile of the references.
"""
import argparse
import copy
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench_kernels import KERNELS, make_case  # the Llama kernels first: a sweep cut short keeps them

KEEP = 1.03  # the current entry stays unless the best is this much faster
# the kernels whose configs are keyed by the row width swept here (the others' rows are a head
# or half of one: they take the heuristic)
HEAD_ROWS = ("rotary", "rotary_pair", "write_kv", "rotary_write_kv")
TUNED = [kernel for kernel in KERNELS if kernel not in HEAD_ROWS]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the tuned TABLE here")
    parser.add_argument("--kernels", default=",".join(TUNED), help="comma-separated subset")
    parser.add_argument("--widths", default="384,576,768,2048,4096", help="comma-separated")
    parser.add_argument("--tokens", type=int, default=4096, help="rows tuned for (default 4096)")
    parser.add_argument("--decode-tokens", type=int, default=8, help="rows of the decode check")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes precompiling the candidates (0: compile in the sweep)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile'd reference")
    parser.add_argument("--rep", type=int, default=20, help="do_bench rep in ms (default 20)")
    parser.add_argument("--pick", choices=("graph", "bench"), default="graph",
                        help="time that picks the config: graph (do_bench_cudagraph, the "
                        "default: kernel time without host overhead or L2 flush, as in a "
                        "captured plan) or bench (do_bench)")
    return parser.parse_args(argv)


def candidates(kernel, width):
    """Norms: 1-16 rows per program up to 4096 elements (one row however wide), 8 or 16
    elements per thread, and one row at 32 per thread; elementwise: 512-8192-element tiles, 8 or
    16 elements per thread. 1-16 warps."""
    from rbcompile.kernels import configs

    if kernel in configs.NORMS:
        block_n = configs.pow2(width)
        shapes = [(rows, per) for rows in (1, 2, 4, 8, 16) if rows == 1 or rows * block_n <= 4096
                  for per in (8, 16)] + [(1, 32)]
        found = [{"rows": rows, "warps": rows * block_n // (32 * per)} for rows, per in shapes]
    else:
        found = [{"block": block, "warps": block // (32 * per)}
                 for block in (512, 1024, 2048, 4096, 8192) for per in (8, 16)]
    return [c for i, c in enumerate(found) if 1 <= c["warps"] <= 16 and c not in found[:i]]


def label(config):
    return " ".join(f"{key}={value}" for key, value in config.items())


def precompile(jobs):
    """Worker: one launch of each (kernel, width, tokens, config), so Triton compiles it to its
    cache; returns the errors."""
    import torch

    from rbcompile.kernels import configs

    errors = []
    for kernel, width, tokens, config in jobs:
        try:
            launcher, _, inputs, _ = make_case(kernel, tokens, width, torch.bfloat16, "cuda")
            with configs.override(config):
                launcher(*inputs)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - reported; the sweep compiles it again
            errors.append(f"{kernel} {width} {label(config)}: {str(error).splitlines()[0]}")
    return errors


def precompile_all(jobs, workers):
    if workers <= 0 or not jobs:
        return
    start = time.perf_counter()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            chunks = pool.map(precompile, [jobs[i::workers] for i in range(workers)])
            errors = [error for chunk in chunks for error in chunk]
    except Exception as error:  # noqa: BLE001 - the sweep compiles what is missing
        print(f"# precompile failed ({error}); the sweep compiles as it goes", flush=True)
        return
    failed = f"; {len(errors)} failed, first: {errors[0]}" if errors else ""
    print(f"# precompiled {len(jobs)} variants in {time.perf_counter() - start:.1f} s on "
          f"{workers} processes{failed}", flush=True)


class Timer:
    def __init__(self, rep):
        import torch
        import triton.testing

        self.torch, self.testing, self.rep = torch, triton.testing, rep

    def ms(self, fn):
        return self.testing.do_bench(fn, warmup=5, rep=self.rep, return_mode="median")

    def picking_ms(self, fn, pick):
        """The time `--pick` compares configs by (do_bench where no CUDA graph can be made)."""
        graph = self.graph_ms(fn) if pick == "graph" else None
        return self.ms(fn) if graph is None else graph

    def graph_ms(self, fn):
        try:
            return self.testing.do_bench_cudagraph(fn, rep=5, return_mode="median")
        except RuntimeError as error:  # not capturable: the column shows "-"
            print(f"# no CUDA graph: {str(error).splitlines()[0]}", flush=True)
            return None

    def wall_us(self, fn, calls=100):
        fn()
        self.torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.torch.cuda.synchronize()
        return 1e6 * (time.perf_counter() - start) / calls


def bind(fn, inputs, config=None):
    """`fn(*inputs)` as a thunk, under configs.override(config) when a config is given."""
    from rbcompile.kernels import configs

    def run():
        if config is None:
            return fn(*inputs)
        with configs.override(config):
            return fn(*inputs)
    return run


def correct(launcher, reference, inputs, config):
    import torch

    got, want = bind(launcher, inputs, config)(), reference(*inputs)
    try:
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    except AssertionError:
        return False
    return True


def launch_params(kernel, tokens, width, config):
    """What the launcher runs with `config` at `tokens` rows (BLOCK_ROWS, BLOCK_N, warps, grid)."""
    from rbcompile.kernels import configs

    with configs.override(config):
        lookup = configs.blocks if kernel in configs.NORMS else configs.tiles
        return lookup(kernel, tokens, width)


def fmt(value, digits=4):
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = (f"{'kernel':15s} {'width':>5s} {'rows':>5s}  {'config':20s} {'ms':>7s} {'table_ms':>8s} "
          f"{'eager_ms':>8s} {'comp_ms':>8s} {'comp/ms':>7s}  {'graph':>7s} {'g_comp':>7s}  "
          f"{'wall_us':>7s} {'w_comp':>7s}")


def report(kernel, width, tokens, config, best, table, eager, compiled, graphs, walls):
    ratio = f"{compiled / best:.2f}x" if compiled else "-"
    flag = " <" if compiled and best > compiled else ""
    print(f"{kernel:15s} {width:5d} {tokens:5d}  {label(config):20s} {fmt(best):>7s} "
          f"{fmt(table):>8s} {fmt(eager):>8s} {fmt(compiled):>8s} {ratio:>7s}  "
          f"{fmt(graphs[0]):>7s} {fmt(graphs[1]):>7s}  {fmt(walls[0], 1):>7s} "
          f"{fmt(walls[1], 1):>7s}{flag}", flush=True)
    return not flag


def sweep(kernel, width, tokens, timer, compiled, contenders, pick):
    """Time `contenders` (configs) of `kernel` at `tokens` x `width` by `pick`'s timer, then
    the table's config (the plain launcher), the eager and compiled references, and print the
    line. Returns (best config, best ms, table ms, met: not slower than the compiled
    reference)."""
    import torch

    launcher, reference, inputs, _ = make_case(kernel, tokens, width, torch.bfloat16, "cuda")
    times = []
    for config in contenders:
        if correct(launcher, reference, inputs, config):
            times.append((timer.picking_ms(bind(launcher, inputs, config), pick), config))
        else:
            print(f"# {kernel} {width}x{tokens}: {label(config)} gives wrong results; skipped",
                  flush=True)
    table_ms = timer.picking_ms(bind(launcher, inputs), pick)
    if not times:
        raise RuntimeError("no candidate config gives the reference's results")
    best_ms, best = min(times, key=lambda item: item[0])
    compiled_ms = timer.picking_ms(bind(compiled, inputs), pick) if compiled else None
    graphs = (timer.graph_ms(bind(launcher, inputs, best)),
              timer.graph_ms(bind(compiled, inputs)) if compiled else None)
    walls = (timer.wall_us(bind(launcher, inputs)),
             timer.wall_us(bind(compiled, inputs)) if compiled else None)
    met = report(kernel, width, tokens, best, best_ms, table_ms,
                 timer.picking_ms(bind(reference, inputs), pick), compiled_ms, graphs, walls)
    return best, best_ms, table_ms, met


def tune_shape(kernel, width, args, timer):
    """Sweep one (kernel, width) at args.tokens, check the decode rows; returns (the new table
    entry, whether every rows count met the compiled reference)."""
    import torch

    from rbcompile.kernels import configs

    torch._dynamo.reset()
    _, reference, _, _ = make_case(kernel, 1, width, torch.bfloat16, "cuda")
    compiled = None if args.no_compile else torch.compile(reference, dynamic=False)
    current = configs.config(kernel, width)
    best, best_ms, table_ms, met = sweep(kernel, width, args.tokens, timer, compiled,
                                         candidates(kernel, width), args.pick)
    chosen = best if best_ms * KEEP < table_ms else current
    if args.decode_tokens:  # the table's and the chosen config, once each if they launch alike
        contenders = {launch_params(kernel, args.decode_tokens, width, c): c
                      for c in (chosen, current)}
        met &= sweep(kernel, width, args.decode_tokens, timer, compiled,
                     list(contenders.values()), args.pick)[3]
    return chosen, met


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"tune_kernels: {error}; nothing tuned") from None
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels: no CUDA device (torch.cuda.is_available() is False); "
                         "nothing tuned")
    from rbcompile.kernels import _triton, configs

    if _triton.interpreting():
        raise SystemExit("tune_kernels: TRITON_INTERPRET is set; unset it to tune on the GPU")
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = set(kernels) - set(configs.NORMS + configs.ELEMENTWISE)
    if unknown:
        raise SystemExit(f"tune_kernels: unknown kernel(s) {', '.join(sorted(unknown))}")
    widths = [int(w) for w in args.widths.split(",") if w]
    start = time.perf_counter()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{_triton.triton.__version__}, bf16; ms = median of the picking timer (--pick "
          f"{args.pick}), graph = do_bench_cudagraph median; comp/ms > 1: faster than "
          f"torch.compile; '<' marks a miss", flush=True)

    rows = [n for n in (args.tokens, args.decode_tokens) if n]
    jobs = [(kernel, width, n, config) for kernel in kernels for width in widths
            for config in candidates(kernel, width) for n in rows]
    precompile_all(jobs, args.jobs)

    timer = Timer(args.rep)
    table = copy.deepcopy(configs.TABLE)
    misses = []
    print(HEADER, flush=True)
    with torch.no_grad():
        for kernel in kernels:
            for width in widths:
                try:
                    chosen, met = tune_shape(kernel, width, args, timer)
                except Exception as error:  # one shape failing keeps its entry, not the sweep
                    print(f"# {kernel}@{width}: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}; entry kept",
                          flush=True)
                    misses.append(f"{kernel}@{width} (failed)")
                    continue
                table.setdefault(kernel, {})[str(width)] = chosen
                if not met:
                    misses.append(f"{kernel}@{width}")
                if args.json:  # after each shape: a sweep killed at its limit keeps its work
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(table, indent=4) + "\n")
    changed = [f"{k}@{w}: {label(configs.TABLE.get(k, {}).get(w) or {})} -> {label(c)}"
               for k, entries in table.items() for w, c in entries.items()
               if configs.TABLE.get(k, {}).get(w) != c]
    print(f"# {len(changed)} table entries changed" + "".join(f"\n#   {c}" for c in changed))
    print(f"# slower than torch.compile at some rows count: {', '.join(misses) or 'none'}")
    print(f"# {time.perf_counter() - start:.0f} s" + (f"; table written to {args.json}"
                                                      if args.json else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
