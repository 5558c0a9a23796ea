"""End-to-end on a GPU: eager vs inductor vs rbcompile, full path and budgets, with parity.

    python benchmarks/bench_gpu.py --out OUT_DIR [--cases bert,smol-prefill,smol-decode,llama1b]
                                   [--deadline-s 300] [--smoke]

Cases (random weights at real sizes: no checkpoint can be fetched on the GPU machine, so quality
at a budget is reported as agreement with the full path, not as task quality):
- `bert`: BERT-base fp16, 32 x 128 (last_hidden_state);
- `smol-prefill`: a SmolLM2-135M-sized Llama in bf16, prefill 8 x 512 (logits);
- `smol-decode`: the same model, `generate` of 128 greedy tokens after a 32-token prompt with a
  static KV cache (tokens/s); `inductor-ro` is transformers' own compile of the forward
  (mode reduce-overhead, its default on CUDA with a static cache), the others disable it;
  `rbc-generate` is the artifact's own KV-cached decoder (CompiledModel.generate, a CUDA graph
  per decode step and plan; budgets skip MLPs; compiled with the CUDA defaults: rbcompile's
  kernels, q / k / v and gate / up stacked), `rbc-generate-unstacked` the same without stacked
  projections;
- `llama1b`: a Llama-3.2-1B-sized model in bf16, prefill 4 x 1024 (logits).

Contenders: `eager` (transformers), `inductor` (torch.compile; `--inductor-mode`), `inductor-ro` (mode reduce-overhead: inductor + CUDA graphs),
`rbc-graphs` (the rbcompile artifact module, eager regions, one CUDA graph per plan and bucket),
`rbc-ind-graphs` (the same with inductor-compiled regions), `rbc-plan-graphs` (one inductor
graph per plan, rbcompile/artifact/plan_graphs.py), `rbc-masked-graphs` (`rbc-graphs` with every
attention reading its all-ones mask, as before passes/unpadded_attention.py),
`rbc-k-graphs` / `rbc-k-noseams-graphs` (rbcompile's Triton kernels, with and without seams:
the residual add fused into the next region's norm), `rbc-k-borrow-graphs` (`rbc-k-graphs`
handing out the graph's output buffers, `use_cuda_graphs(borrow_outputs=True)`, instead of a
copy: inductor's default mode makes none either, its outputs are fresh), and
for decoding `rbc-backend` (torch.compile(backend="rbcompile", options={"cuda_graphs": True})),
`rbc-backend-plan` (the same with `regions="plan"`) and `rbc-generate-plan` (`rbc-generate`
through plan graphs). `rbc-backend*` run rbcompile's Triton kernels on CUDA (the backend's
default there). Times are medians of wall times synchronised around each run, after warm-up;
the last timed run's output of every contender's full path is checked against eager in the same
dtype (rbcompile/artifact/placement.py tolerances), budgets' against eager's top-1 (and their share of
skipped FLOPs is recorded); the artifact rows record their CUDA graph counts (captures,
replays, eager calls, memory fallbacks). The contenders the issue's targets need run first
in every case (prefill: eager, inductor, inductor-ro, rbc-graphs, rbc-k-graphs,
rbc-k-borrow-graphs; decode: inductor-ro, rbc-generate), the others after all of those, in case
order (each case's model stays in memory until its extras ran); contenders (and cases) that
would start after `--deadline-s` are skipped and listed. The prefill cases compile the
artifact once per kernel setting and load a fresh copy per contender. `--smoke` runs tiny
configs (on CPU too) to test the script itself. Writes OUT_DIR/bench_gpu.json after each row,
atomically (a run killed at its time limit keeps the rows it finished, and a SIGTERM still
prints the table). `--profile` contenders get one more call of their full path under
torch.profiler: device time by kind of kernel (gemm, attention, inductor's Triton, rbcompile's
Triton, copies, other) and the longest kernels, next to the wall time, so a miss says where its
time goes. The summary ends with the
issue's targets (`TARGETS`), each met or not by the best rbcompile row (also in the JSON).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = ("smol-decode", "llama1b", "bert", "smol-prefill")  # run order: unmeasured first

# issue 18's targets: (case, budget, reference contenders, least speedup: the reference's time
# over the fastest rbcompile row's at that budget whose full path has parity)
TARGETS = [("bert", 0.0, ("inductor", "inductor-ro"), 1 / 1.05),     # full path <= 1.05x
           ("llama1b", 0.0, ("inductor", "inductor-ro"), 1 / 1.05),
           ("bert", 0.25, ("inductor", "inductor-ro"), 1.25),        # the full model's time
           ("smol-decode", 0.0, ("inductor-ro",), 1.0)]               # tokens/s
BUDGETS = (0.25, 0.5)


def configs(smoke: bool) -> dict:
    from transformers import BertConfig, LlamaConfig

    if smoke:  # 4 layers: enough for the budgets' plans to skip some (2 layers: none)
        bert = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=256)
        small = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256)
        return {"bert": (bert, torch.float32, 2, 16), "smol-prefill": (small, torch.float32, 2, 32),
                "smol-decode": (small, torch.float32, 8, 8), "llama1b": (small, torch.float32, 1, 64)}
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True)
    llama1b = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=131072, rope_theta=500000.0,
                          tie_word_embeddings=True, head_dim=64)
    return {"bert": (BertConfig(), torch.float16, 32, 128),
            "smol-prefill": (smol, torch.bfloat16, 8, 512),
            "smol-decode": (smol, torch.bfloat16, 32, 128),
            "llama1b": (llama1b, torch.bfloat16, 4, 1024)}


def make_model(config, dtype, device):
    """Random weights, made on `device` (a 1B model's CPU initialisation takes over a minute)."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    auto = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
    with torch.device(device):
        return auto.from_config(config, dtype=dtype).eval()


def free_memory(device):
    """Collect what the last contender or case left, and give its cached CUDA memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, runs: int, warmup: int = 3) -> float:
    """Median wall time of `fn()` in ms (CUDA-synchronised around each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


# what a kernel does, from its name (lower-cased); the first kind with a matching part wins
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "efficient")),
                ("gemm", ("gemm", "cutlass", "cublas", "xmma", "nvjet", "triton_tem", "splitk",
                          "aten::mm", "aten::addmm", "aten::bmm")),  # the last: CPU ops
                ("inductor triton", ("triton_",)),
                ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")))


def kernel_kind(name: str) -> str:
    name = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(part in name for part in parts):
            return kind
    if name.startswith("_") and name.endswith("_kernel"):  # kernels/*.py: _rms_norm_kernel, ...
        return "rbcompile triton"
    return "other"


def kernel_profile(fn, device, top: int = 12) -> dict:
    """Where one call of `fn` spends device time: its kernels (CUDA; CPU: its ops' self time)
    summed by kind and by name, the `top` longest names with their calls. Kernels replayed
    from a CUDA graph count as the profiler reports them (`events` 0: it reported none)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    by_name: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != (DeviceType.CUDA if cuda else DeviceType.CPU):
            continue
        us = event.time_range.elapsed_us() if cuda else event.self_cpu_time_total
        calls_us = by_name.setdefault(event.name, [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += us
    by_kind: dict[str, float] = {}
    for name, (_, us) in by_name.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    longest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"events": sum(calls for calls, _ in by_name.values()),
            "total_ms": sum(by_kind.values()) / 1e3,
            "by_kind_ms": {kind: round(us / 1e3, 4) for kind, us in
                           sorted(by_kind.items(), key=lambda item: -item[1])},
            "top": [[name[:80], calls, round(us / 1e3, 4)] for name, (calls, us) in longest]}


def first_tensor(out):
    if isinstance(out, dict):
        return out.get("logits", out.get("last_hidden_state"))
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


class Case:
    """Runs contenders of one case, recording rows; skips those past the deadline. `extra`
    contenders (those no target needs) go to `deferred`, when given: every case's target rows
    come first, the extras after them while the deadline allows. `tokens`: tokens a call
    generates (decode: the rows get tokens/s)."""

    def __init__(self, name, deadline, device, runs, warmup=3, save=lambda: None,
                 deferred: list | None = None, tokens: int | None = None):
        self.name, self.deadline, self.device, self.runs = name, deadline, device, runs
        self.warmup, self.deferred, self.tokens = warmup, deferred, tokens
        self.rows, self.skipped, self.skip, self.profile = [], [], set(), set()
        self.save = save  # called after each row: a run killed at its limit keeps what it did

    def contender(self, label, setup, budgets=(None,), runs=None, extra=False):
        """`setup()` -> (run(budget) -> output tensor or None, reference output), and any
        `notes(budget) -> dict` of fields for the row (plan_failures, graph counts, skipped
        share; a "check" field is appended to the row's check). One row per budget: median ms
        over `runs` (default the case's), and parity with eager (full path) or agreement
        (budgets) of the last timed run's output; a label in `profile` gets its full path's
        kernels (`kernel_profile`) in its first row."""
        if extra and self.deferred is not None:
            self.deferred.append((self, (label, setup, budgets, runs)))
            return
        if label in self.skip or time.monotonic() > self.deadline:
            self.skipped.append(label)
            why = "--skip" if label in self.skip else "deadline"
            print(f"  {self.name}/{label}: skipped ({why})", flush=True)
            return
        torch._dynamo.reset()
        start = time.monotonic()
        try:
            run, reference, *notes = setup()
            run(None)
            sync(self.device)
            compile_s = time.monotonic() - start
            for budget in budgets:
                last = []

                def timed(budget=budget):
                    last[:] = [run(budget)]
                ms = time_ms(timed, self.device, runs or self.runs, self.warmup)
                row = self.row(label, budget, ms, compile_s, last[0], reference)
                self.rows.append(row)
                for note in notes:
                    fields = note(budget)
                    if "check" in fields:
                        row["check"] += "; " + fields.pop("check")
                    row.update(fields)
                print(f"  {self.name}/{label} budget {budget or 0:g}: {ms:.3f} ms "
                      f"(setup {compile_s:.0f} s) {row['check']}", flush=True)
                self.save()
            if label in self.profile:
                self._profile(self.rows[-len(budgets)], lambda: run(None))
        except Exception as exc:  # one contender failing must not lose the others' numbers
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"  {self.name}/{label}: FAILED {message}", flush=True)
            self.rows.append({"case": self.name, "contender": label, "error": message[:300]})
            self.save()
        finally:  # the contender's graphs and pools go before the next one's are captured
            free_memory(self.device)

    def _profile(self, row, fn):
        """The full path's kernels into `row` (a profiler failing loses only them)."""
        try:
            row["kernels"] = kernels = kernel_profile(fn, self.device)
        except Exception as exc:
            row["kernels_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"  {self.name}/{row['contender']}: profile FAILED {row['kernels_error']}", flush=True)
            return
        kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in kernels["by_kind_ms"].items())
        print(f"  {self.name}/{row['contender']} kernels: {kernels['total_ms']:.2f} ms in "
              f"{kernels['events']} ({kinds}) of {row['ms']:.2f} ms wall", flush=True)
        self.save()

    def row(self, label, budget, ms, compile_s, out, reference):
        from rbcompile.artifact.placement import within_tolerance

        row = {"case": self.name, "contender": label, "budget": budget or 0.0, "ms": ms,
               "setup_s": compile_s}
        if self.tokens:
            row["tokens_per_s"] = self.tokens / (ms / 1e3)
        if reference is None or out is None:
            row["check"] = ""
        elif out.dtype in (torch.int64, torch.int32):  # generated tokens
            row["token_match"] = float((out == reference).float().mean())
            row["check"] = f"tokens equal to eager {row['token_match']:.1%}"
        elif budget:
            agree = (out.argmax(-1) == reference.argmax(-1)).float().mean().item()
            row["top1_agreement"] = agree
            row["check"] = f"top-1 agreement with eager {agree:.1%}"
        else:
            ok, diff = within_tolerance(out, reference)
            row.update(parity=ok, max_abs_diff=diff)
            row["check"] = f"parity {'ok' if ok else 'FAIL'} (max abs diff {diff:.2g})"
        return row


def plan_failures(compiled) -> dict:
    """Plans of the artifact (and its decoder) whose compile failed (they ran the interpreter)."""
    graphs = [g for g in (compiled.plan_graphs, getattr(compiled.decoder, "plan_graphs", None)) if g]
    failures = sum(g.stats.failures for g in graphs)
    return ({"plan_failures": failures} if graphs else {}) | (
        {"check": f"{failures} plan compiles failed"} if failures else {})


def graph_counts(graphs) -> dict:
    """What a GraphCache did so far (nothing without CUDA graphs): a row whose calls ran
    eagerly (no memory, a failed capture) says so."""
    if graphs is None:
        return {}
    stats = graphs.stats
    return {"graph_captures": stats.captures, "graph_replays": stats.replays,
            "graph_repeats": stats.repeats, "graph_eager_calls": stats.eager_calls,
            "graph_memory_fallbacks": stats.memory_fallbacks,
            "graph_capture_failures": stats.capture_failures}


def artifact_notes(compiled, graphs, skipped):
    """notes(budget) of an artifact contender: failed plan compiles, graph counts, and
    `skipped(budget)`, the share of FLOPs the budget's plan skips (0 would mean it ran the full
    path)."""
    def notes(budget):
        return {**plan_failures(compiled), **graph_counts(graphs()),
                "unpadded_attention": compiled.unpadded_attention
                and getattr(compiled.module, "UNPADDED", None) is not None,
                "skipped_share": skipped(budget) if budget else 0.0}
    return notes


def prefill_case(case: Case, model, batch, seq, args):
    import rbcompile
    from rbcompile.artifact.guard import UNGUARDED

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(case.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        reference = first_tensor(model(input_ids=ids, attention_mask=mask))

    def hf(compiled, graphs=False):
        def run(budget):
            with torch.no_grad():
                # cudagraph trees reuse output memory: copied out, as rbcompile's graphs do
                # unless they lend their buffers (rbc-k-borrow-graphs)
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                    return first_tensor(compiled(input_ids=ids, attention_mask=mask)).clone()
                return first_tensor(compiled(input_ids=ids, attention_mask=mask))
        return run, reference

    case.contender("eager", lambda: hf(model))
    case.contender("inductor", lambda: hf(torch.compile(model, mode=args.inductor_mode)))
    if case.device.type == "cuda":
        case.contender("inductor-ro", lambda: hf(torch.compile(model, mode="reduce-overhead"), True))

    saved = {}  # kernels -> artifact folder: tracing the model and its decoder once

    def artifact(engine="interp", kernels=False, seams=True, unpadded=True, borrow=False):
        def setup():
            if kernels not in saved:
                saved[kernels] = rbcompile.compile(model, kernels=kernels).save(
                    Path(args.scratch) / f"{case.name}-kernels{int(kernels)}")
            compiled = rbcompile.load(saved[kernels], device=case.device)
            compiled.guard = UNGUARDED   # the budget rows time unmeasured plans
            compiled.module.fuse_seams = seams
            compiled.unpadded_attention = unpadded
            if engine == "regions":
                compiled.compile_regions()
            elif engine == "plan":
                compiled.compile_plans()
            if case.device.type == "cuda":
                compiled.use_cuda_graphs(borrow_outputs=borrow)
            name = compiled.output_names[0]
            return ((lambda budget: compiled(ids, mask, budget=budget)[name]), reference,
                    artifact_notes(compiled, lambda: compiled.cuda_graphs,
                                   lambda b: compiled.skipped_share(*compiled.plan_for_budget(b))))
        return setup

    graphs = "-graphs" if case.device.type == "cuda" else ""
    case.contender(f"rbc{graphs}", artifact(), (None, *BUDGETS))
    case.contender(f"rbc-k{graphs}", artifact(kernels=True), (None, BUDGETS[0]))  # CUDA's default
    if graphs:  # without the copy out of the graph (the 1B's logits: 1 GB)
        case.contender("rbc-k-borrow-graphs", artifact(kernels=True, borrow=True))
    case.contender(f"rbc-masked{graphs}", artifact(unpadded=False), (None,), extra=True)
    case.contender(f"rbc-ind{graphs}", artifact("regions"), (None, *BUDGETS), extra=True)
    case.contender(f"rbc-plan{graphs}", artifact("plan"), (None, BUDGETS[0]), extra=True)
    case.contender(f"rbc-k-noseams{graphs}", artifact(kernels=True, seams=False), (None,),
                   extra=True)


def decode_case(case: Case, model, prompt, new, args):
    from rbcompile.frontend import backend

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=generator).to(case.device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    forward = model.forward
    # On CUDA with a static cache, transformers compiles its own forward (mode reduce-overhead)
    # unless told not to: that is the `inductor-ro` contender; the others disable it.
    settings = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    cache_implementation="static")

    def generate(budget=None, hf_compile=False):
        with torch.no_grad(), backend.decision(budget=budget):
            return model.generate(ids, attention_mask=torch.ones_like(ids), **settings,
                                  disable_compile=not hf_compile)[:, prompt:]

    reference = generate()

    def patched(compiled_forward, hf_compile=False, notes=()):
        def setup():
            model.forward = compiled_forward
            return (lambda budget: generate(budget, hf_compile)), reference, *notes
        return setup

    def backend_graphs(budget):  # the contender's graphs (backend_contender resets the list)
        handled = [graph.handled_by for graph in backend.compiled_graphs()]
        graphs = {by: handled.count(by) for by in set(handled)}
        gates = sorted({graph.num_gates for graph in backend.compiled_graphs()
                        if graph.handled_by == "rbcompile"})
        return {"graphs": graphs, "gates": gates, "check": f"graphs {graphs}, gates {gates}"}

    if case.device.type == "cuda":
        case.contender("inductor-ro", patched(forward, hf_compile=True))

    def artifact_generate(plans=False, stack=None):
        def setup():
            import rbcompile
            from rbcompile.artifact.guard import UNGUARDED

            model.forward = forward  # trace the model itself, not a compiled forward
            compiled = rbcompile.compile(model, stack_projections=stack)  # None: on CUDA
            compiled.guard = UNGUARDED   # the budget rows time unmeasured plans
            compiled.hf_config["eos_token_id"] = None  # all `new` tokens, like the others
            if plans:
                compiled.compile_plans()
            if case.device.type == "cuda":
                compiled.use_cuda_graphs()

            def run(budget):
                result = compiled.generate(ids, max_new_tokens=new, budget=budget)
                return torch.tensor(result.tokens, device=case.device)
            return run, reference, artifact_notes(  # a decode step skips MLPs only
                compiled, lambda: compiled.decoder.graphs,
                lambda b: 1.0 - compiled.decoder.cost(compiled.decoder_gates(b)))
        return setup

    cuda = case.device.type == "cuda"
    # every plan allowed: the budget rows time plans the guard would withhold (no quality here)
    options = {"cuda_graphs": cuda, "regions": "eager", "kernels": cuda,
               "allow_unmeasured_plans": True}

    def backend_contender(**changed):
        compiled_forward = torch.compile(forward, backend="rbcompile", options={**options, **changed})

        def setup():
            backend.reset()
            return patched(compiled_forward, notes=(backend_graphs,))()
        return setup

    # the contenders the targets need first; eager (25 tok/s at SmolLM2 size) once, late
    case.contender("rbc-generate", artifact_generate(), (None, *BUDGETS))
    case.contender("rbc-backend", backend_contender(), (None, *BUDGETS), extra=True)
    case.contender("eager", patched(forward), runs=1, extra=True)
    case.contender("rbc-generate-plan", artifact_generate(plans=True), (None, BUDGETS[0]), extra=True)
    case.contender("rbc-backend-plan", backend_contender(regions="plan"), (None,), extra=True)
    # rbc-generate without stacked projections (passes/fuse_projections.py): what they save
    case.contender("rbc-generate-unstacked", artifact_generate(stack=False), (None,), extra=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_gpu.json")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="start no contender after this many seconds (default 300)")
    parser.add_argument("--inductor-mode", default="default",
                        help="mode of the `inductor` contender (max-autotune-no-cudagraphs "
                        "compiles BERT-base in ~50 s and SmolLM2-sized prefill in ~140 s on an "
                        "H200: too long for a short lease)")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per contender")
    parser.add_argument("--decode-runs", type=int, default=5,
                        help="timed generate calls per decode contender (default 5)")
    parser.add_argument("--smoke", action="store_true", help="tiny configs (CPU allowed)")
    parser.add_argument("--skip", default="", help="comma-separated contenders not to run")
    parser.add_argument("--profile", default="",
                        help="comma-separated contenders whose full path's kernels are profiled "
                        "once after timing (time by kind and by kernel name, in the JSON rows)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_gpu: no CUDA device (use --smoke to test the script on CPU)", file=sys.stderr)
        return 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    deadline = time.monotonic() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    table = configs(args.smoke)
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "cases": {}}
    def save():  # atomically: a kill while writing leaves the previous rows
        partial = args.out / "bench_gpu.json.partial"
        partial.write_text(json.dumps(results, indent=1))
        os.replace(partial, args.out / "bench_gpu.json")

    # gpu_check's `timeout` sends SIGTERM at the step's limit: stop there, keep and print the rows
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu_") as scratch:
            args.scratch = scratch  # artifacts the prefill contenders load
            deferred = []  # (case, contender arguments) of the extras, in case order
            for name in cases:
                run_case(name, table[name], deadline, device, args, results, save, deferred)
            if deferred:
                print("extras (no target needs them):", flush=True)
            for case, contender in deferred:
                case.contender(*contender)
    finally:
        results["targets"] = target_checks(results)
        save()
        print_summary(results)
    return 0


def run_case(name, spec, deadline, device, args, results, save, deferred):
    config, dtype, first, second = spec
    print(f"{name}: {config.model_type} hidden {config.hidden_size} x "
          f"{config.num_hidden_layers} layers, {str(dtype)[6:]}", flush=True)
    decode = name == "smol-decode"  # one generate warms up its 128 forward calls
    runs = 3 if args.smoke else args.decode_runs if decode else args.runs
    case = Case(name, deadline, device, runs, 1 if decode else 3, save, deferred,
                tokens=second if decode else None)
    case.skip, case.profile = set(args.skip.split(",")), set(args.profile.split(","))
    results["cases"][name] = {"shape": [first, second], "dtype": str(dtype), "rows": case.rows,
                              "skipped": case.skipped}
    if time.monotonic() > deadline:  # not even the model and its reference
        case.skipped.append("all (deadline)")
        print(f"  {name}: skipped (deadline)", flush=True)
        return
    model = make_model(config, dtype, device)
    if decode:
        decode_case(case, model, first, second, args)
    else:
        prefill_case(case, model, first, second, args)
    save()
    del model
    free_memory(device)


def target_checks(results) -> list[dict]:
    """Each of `TARGETS` against the rows in `results`: the fastest rbcompile row (a full path
    only with parity) and the fastest reference row, their speedup, and whether it is met;
    `met` None where either row is missing (not run, failed, past the deadline)."""
    checks = []
    for name, budget, references, least in TARGETS:
        rows = [r for r in results["cases"].get(name, {}).get("rows", []) if "ms" in r]
        rbc = [r for r in rows if r["contender"].startswith("rbc") and r["budget"] == budget
               and (budget or r.get("parity", True))]
        reference = [r for r in rows if r["contender"] in references and not r["budget"]]
        best, base = (min(found, key=lambda r: r["ms"], default=None) for found in (rbc, reference))
        check = {"case": name, "budget": budget, "least_speedup": least, "met": None}
        if best and base:
            speedup = base["ms"] / best["ms"]
            check.update(rbcompile=best["contender"], rbcompile_ms=best["ms"],
                         reference=base["contender"], reference_ms=base["ms"], speedup=speedup,
                         met=speedup >= least)
        checks.append(check)
    return checks


def print_summary(results):
    print(f"\nbench_gpu {results['date']} on {results['device']} (torch {results['torch']}); "
          "ms = median per forward (decode: per generate of all tokens)")
    for name, case in results["cases"].items():
        peers = {r["contender"]: r["ms"] for r in case["rows"] if "ms" in r and not r["budget"]}
        best_inductor = min((v for k, v in peers.items() if k.startswith("inductor")), default=None)
        for r in case["rows"]:
            if "error" in r:
                print(f"  {name:<13} {r['contender']:<15} FAILED {r['error'][:100]}")
                continue
            ratio = f"{best_inductor / r['ms']:.2f}x best inductor" if best_inductor else ""
            tps = f" {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else ""
            print(f"  {name:<13} {r['contender']:<15} b={r['budget']:<4g} {r['ms']:9.3f} ms{tps} "
                  f"{ratio:>22}  {r['check']}")
            if "kernels" in r:
                kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in r["kernels"]["by_kind_ms"].items())
                print(f"  {'':<13} {'':<15} kernels {r['kernels']['total_ms']:.2f} ms: {kinds}")
        if case["skipped"]:
            print(f"  {name:<13} skipped (deadline or --skip): {', '.join(case['skipped'])}")
    print("targets (speedup: the reference's time over rbcompile's; full paths with parity):")
    for t in results["targets"]:
        goal = f"b={t['budget']:<4g} speedup >= {t['least_speedup']:.2f}x"
        if t["met"] is None:
            print(f"  {t['case']:<13} {goal}: not measured (a row is missing)")
            continue
        print(f"  {t['case']:<13} {goal}: {t['rbcompile']} {t['rbcompile_ms']:.3f} ms vs "
              f"{t['reference']} {t['reference_ms']:.3f} ms = {t['speedup']:.2f}x "
              f"{'met' if t['met'] else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
