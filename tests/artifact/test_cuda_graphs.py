"""CUDA graphs per plan, tested on CPU with a fake capture: what a key is, lazy capture, the
bound and LRU eviction, memory fallback, in-place inputs, copies in and out, and the artifact's
padding to buckets (outputs equal the unpadded run)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rbcompile
from rbcompile.artifact.cuda_graphs import GraphCache

from conftest import TINY_VOCAB, make_tiny_model, unguarded
from shared import FakeCapture


def _cache(run, **kwargs):
    capture = FakeCapture()
    return GraphCache(run, capture=capture, **kwargs), capture


def test_key_shapes_lazy_capture_and_copies():
    calls = []

    def run(x, scale):
        calls.append(scale)
        return x * scale

    cache, capture = _cache(run, capture_after=2)
    x = torch.ones(3)
    assert torch.equal(cache("plan-a", x, 2.0), 2 * x)          # first sight: eager
    assert cache.stats.eager_calls == 1 and len(cache) == 0
    out = cache("plan-a", x, 2.0)                                  # second: captured
    assert cache.stats.captures == 1 and len(cache) == 1
    y = torch.full((3,), 5.0)
    again = cache("plan-a", y, 2.0)                                # replay reads the copied input
    assert torch.equal(again, 2 * y) and cache.stats.replays == 2
    assert torch.equal(out, 2 * x)                                 # earlier outputs untouched
    assert capture.captured[0][0] is not x                         # the graph owns its input
    cache("plan-a", torch.ones(4), 2.0)                            # new shape: a new key
    assert cache.stats.captures == 1 and cache.stats.eager_calls == 2


def _owns_its_memory(tensor) -> bool:
    """Whether `tensor` is a copy of its own, not a view into a larger buffer."""
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_a_replay_copies_out_what_the_call_selects_or_lends_its_buffers():
    """`select` picks what a call returns: after a replay that part alone is copied out (an
    eager call's fresh outputs are not copied); with `borrow_outputs` nothing is, and the next
    replay overwrites what the last one returned."""
    def run(x):
        return x * 2, x.sum(0)

    def first_rows(outputs):
        return [outputs[0][:2], outputs[1]]

    x, y = torch.ones(4, 3), torch.full((4, 3), 5.0)
    cache, _ = _cache(run, capture_after=2)
    eager = cache("plan", x, select=first_rows)
    assert cache.stats.eager_calls == 1 and not _owns_its_memory(eager[0])  # a view of run's
    out = cache("plan", x, select=first_rows)                                # captured, replayed
    assert cache.stats.replays == 1 and out[0].shape == (2, 3)
    assert all(map(_owns_its_memory, out)) and torch.equal(out[0], 2 * x[:2])
    cache("plan", y, select=first_rows)
    assert torch.equal(out[0], 2 * x[:2])                  # a copy: the next replay leaves it

    lent, _ = _cache(run, borrow_outputs=True)
    out = lent("plan", x, select=first_rows)
    assert torch.equal(out[0], 2 * x[:2]) and not _owns_its_memory(out[0])
    again = lent("plan", y, select=first_rows)
    assert again[0].data_ptr() == out[0].data_ptr()        # the graph's own buffer, both times
    assert torch.equal(out[0], 2 * y[:2])                  # overwritten by the next replay


def test_other_inputs_key_the_graph():
    """A graph holds the ints and floats it was captured with (dynamo passes an int that
    changes between calls as an input): another value is another graph, not a stale replay."""
    cache, _ = _cache(lambda x, scale, gates: x * scale + sum(gates))
    x = torch.ones(2)
    for scale in (2, 3, 2):
        assert torch.equal(cache("plan", x, scale, [1, 1]), x * scale + 2)
    assert cache.stats.captures == 2 and cache.stats.replays == 3


def test_bound_evicts_least_recently_used():
    cache, _ = _cache(lambda x, gates: x + sum(gates), max_graphs=2)
    x = torch.zeros(2)
    for plan in [(1,), (1, 1), (1,), (1, 1, 1)]:
        cache(plan, x, plan)
    assert cache.stats.captures == 3 and cache.stats.evictions == 1
    assert [key[0] for key in cache.keys()] == [(1,), (1, 1, 1)]   # (1, 1) was least recent


def test_memory_short_runs_eagerly():
    free = [0.5]
    cache = GraphCache(lambda x: x + 1, capture=FakeCapture(), min_free_fraction=0.1,
                       free_fraction=lambda inputs: free[0])
    free[0] = 0.01
    assert torch.equal(cache("k", torch.zeros(2)), torch.ones(2))
    assert cache.stats.memory_fallbacks == 1 and len(cache) == 0
    free[0] = 0.5
    cache("k", torch.zeros(2))
    assert len(cache) == 1


def test_a_failed_capture_evicts_nothing():
    outcomes = iter([None, RuntimeError("operation not permitted when stream is capturing")])

    def capture(run, inputs):
        failure = next(outcomes)
        if failure:
            raise failure
        return FakeCapture()(run, inputs)

    cache = GraphCache(lambda x: x + 1, capture=capture, max_graphs=1)
    cache("kept", torch.zeros(1))
    assert torch.equal(cache("fails", torch.zeros(1)), torch.ones(1))
    assert [key[0] for key in cache.keys()] == ["kept"] and cache.stats.evictions == 0


def test_inputs_off_cuda_run_eagerly_under_the_real_capture():
    """The CUDA capture runs on its inputs' device; with none on CUDA (a model moved off it)
    the key runs eagerly, with the right values, instead of capturing an empty graph."""
    cache = GraphCache(lambda x: x * 2)
    for _ in range(2):
        assert torch.equal(cache("k", torch.ones(2)), torch.full((2,), 2.0))
    assert cache.stats.capture_failures == 1 and len(cache) == 0


def test_calls_from_two_threads_get_their_own_outputs():
    """A graph's input buffers are shared: a call holds the cache from its copy-in to its
    copy-out, so a call on another thread never replays with its inputs."""
    import threading

    compiled = rbcompile.compile(make_tiny_model("bert"))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, TINY_VOCAB, (2, 40), generator=generator) for _ in range(2)]
    expected = [compiled(ids)["last_hidden_state"] for ids in inputs]
    compiled.use_cuda_graphs(capture=FakeCapture())
    wrong = [0, 0]

    def calls(index):
        for _ in range(60):
            try:
                got = compiled(inputs[index])["last_hidden_state"]
            except Exception:  # the cache's own state torn by the other thread
                got = torch.full_like(expected[index], float("nan"))
            wrong[index] += not (got - expected[index]).abs().max().item() <= 1e-5

    threads = [threading.Thread(target=calls, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [0, 0] and compiled.cuda_graphs.stats.replays >= 119


def test_uncapturable_key_runs_eagerly_from_then_on():
    def capture(run, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    cache = GraphCache(lambda x: x * 3, capture=capture)
    for _ in range(3):
        assert torch.equal(cache("k", torch.ones(1)), torch.full((1,), 3.0))
    assert cache.stats.capture_failures == 1 and cache.stats.eager_calls == 3


def test_in_place_inputs_are_read_where_they_are_and_key_by_address():
    kv, other = torch.zeros(4), torch.zeros(4)
    cache, capture = _cache(lambda x, cache_: cache_ + x,
                            in_place=lambda t: t is kv or t is other)
    cache("step", torch.ones(4), kv)
    assert capture.captured[0][1] is kv                  # not copied
    kv += 10
    assert torch.equal(cache("step", torch.ones(4), kv), torch.full((4,), 11.0))
    cache("step", torch.ones(4), other)                  # another address: another graph
    assert cache.stats.captures == 2 and capture.captured[1][1] is other


def test_inputs_a_run_writes_are_read_in_place_by_position():
    """`in_place_at`: the positions of inputs the run writes (a torch.compile graph's cache
    writes) are read where they are, so a replay's write reaches the caller's tensor, once per
    call (the capture's runs are undone); a copied input's write would stay in the graph's own
    buffer."""
    def run(x, counter):
        counter.add_(x)
        return counter * 2

    for in_place_at in (frozenset({1}), frozenset()):
        cache, capture = _cache(run, in_place_at=in_place_at)
        counter = torch.zeros(2)
        for _ in range(3):
            cache("step", torch.ones(2), counter)
        assert cache.stats.replays == 3 and (capture.captured[0][1] is counter) == bool(in_place_at)
        assert torch.equal(counter, torch.full((2,), 3.0 if in_place_at else 0.0))


def test_a_repeated_call_replays_its_graph_without_keying_every_input(monkeypatch):
    """A call whose in-place inputs are the objects the last replay read (a decode step's cache)
    is matched by identity and the other inputs' keys: only those are keyed again. Any change
    the full key sees still picks another graph: another plan, another shape or value of the
    other inputs, another in-place tensor of the same shape, an in-place tensor at a copied
    input's place; and a graph dropped since is not replayed."""
    kv, other = [torch.zeros(3) for _ in range(4)], [torch.ones(3) for _ in range(4)]
    in_place = {id(t) for t in kv + other}
    cache, _ = _cache(lambda x, scale, *kv_: sum(kv_) * scale + x,
                      in_place=lambda t: id(t) in in_place)
    keyed = []
    keys = cache._input_keys
    monkeypatch.setattr(cache, "_input_keys", lambda inputs, positions=None: (
        keyed.append(len(inputs) if positions is None else len(positions))
        or keys(inputs, positions)))

    def call(plan, x, scale, tensors):
        return cache(plan, x, scale, *tensors)

    call("a", torch.ones(3), 2, kv)                     # captured: fully keyed
    keyed.clear()
    for step in range(3):
        kv[0] += 1
        assert torch.equal(call("a", torch.full((3,), float(step)), 2, kv),
                           kv[0] * 2 + step)
    assert keyed == [2, 2, 2] and cache.stats.replays == 4     # x and scale only
    for change in [("b", torch.ones(3), 2, kv), ("a", torch.ones(1), 2, kv),
                   ("a", torch.ones(3), 3, kv), ("a", torch.ones(3), 2, other),
                   ("a", kv[1], 2, [torch.ones(3), *kv[1:]])]:
        keyed.clear()
        expected = sum(change[3]) * change[2] + change[1]
        assert torch.equal(call(*change), expected)
        assert keyed[-1] == 6                                  # keyed in full: not the last graph
    assert cache.stats.captures == 6
    call("a", torch.ones(3), 2, kv)                             # the first graph, replayed
    assert cache.stats.captures == 6
    cache.forget(kv)                                            # 5 graphs read kv, 1 other
    keyed.clear()
    assert torch.equal(call("a", torch.ones(3), 2, kv), kv[0] * 2 + 1)
    assert keyed == [6] and cache.stats.released == 5 and cache.stats.captures == 7


def test_forgotten_tensors_take_the_graphs_that_read_them_along():
    """`forget(tensors)` drops the graphs that read them (or views of them) in place, so that
    they leave memory; graphs over other tensors stay, and a later call captures anew."""
    import gc
    import weakref

    kv, other = torch.zeros(2, 4), torch.zeros(2, 4)
    cache, capture = _cache(lambda x, cache_: cache_ + x, in_place=lambda t: t.dim() == 2)
    view = kv[:1]
    read = weakref.ref(view)
    cache("step", torch.ones(4), view)
    cache("step", torch.ones(4), other)
    del view
    cache.forget([kv])
    capture.captured.clear()   # what the fake capture keeps for the other tests
    gc.collect()
    assert read() is None and cache.stats.released == 1 and len(cache) == 1
    assert torch.equal(cache("step", torch.ones(4), other), torch.ones(2, 4))
    assert cache.stats.captures == 2                    # the other graph replayed
    assert torch.equal(cache("step", torch.ones(4), kv[:1]), torch.ones(1, 4))
    assert cache.stats.captures == 3


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_graphs and capture_after must be >= 1"):
        GraphCache(lambda: None, max_graphs=0, capture=FakeCapture())


def test_artifact_pads_to_buckets_and_cuts_back():
    model = make_tiny_model("bert")
    compiled = unguarded(rbcompile.compile(model))
    compiled.use_cuda_graphs(capture=FakeCapture(), max_graphs=3, batch_buckets=(1, 4),
                             seq_multiple=16)
    assert compiled.module.region_cache.enabled is False
    generator = torch.Generator().manual_seed(0)
    for batch, seq in [(2, 10), (3, 13), (1, 5), (2, 10)]:
        ids = torch.randint(3, TINY_VOCAB, (batch, seq), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        got = compiled(ids, mask)["last_hidden_state"]
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert got.shape == expected.shape and _owns_its_memory(got)  # the call's part copied
        assert ((got - expected) * mask[..., None]).abs().max().item() <= 1e-5
    keys = compiled.cuda_graphs.keys()
    shapes = sorted({key[1][0][0] for key in keys})              # (padded batch, padded seq)
    assert shapes == [(1, 16), (4, 16)] and compiled.cuda_graphs.stats.replays == 4
    compiled(ids, mask, budget=0.3)                               # another plan: another graph
    assert len(compiled.cuda_graphs) == 3
    compiled.use_cuda_graphs(False)
    assert compiled.cuda_graphs is None and compiled.module.region_cache.enabled


def test_borrowed_outputs_are_the_graphs_buffers_cut_to_the_call():
    """`use_cuda_graphs(borrow_outputs=True)`: no copy out; a call's outputs are (views of) the
    graph's buffers, which the next call overwrites."""
    model = make_tiny_model("bert")
    compiled = rbcompile.compile(model)
    compiled.use_cuda_graphs(capture=FakeCapture(), batch_buckets=(2,), seq_multiple=16,
                             borrow_outputs=True)
    generator = torch.Generator().manual_seed(0)
    ids, other = (torch.randint(3, TINY_VOCAB, (2, 16), generator=generator) for _ in range(2))
    first = compiled(ids)["last_hidden_state"]
    assert (first - model(input_ids=ids).last_hidden_state).abs().max().item() <= 1e-5
    second = compiled(other)["last_hidden_state"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(first, second)
    short = ids[:1, :9]                                            # padded to (2, 16), cut back
    got = compiled(short)["last_hidden_state"]
    assert got.shape == (1, 9, 32) and not _owns_its_memory(got)  # a view of a (2, 16) buffer
    assert (got - model(input_ids=short).last_hidden_state).abs().max().item() <= 1e-5


class HostWork(TorchFunctionMode):
    """Counts what runs on the host around a replay: device-to-host reads (`reads`) and
    tensor ops by name (`ops`, through `OpCounter`)."""
    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        benchmarks = str(Path(__file__).parents[2] / "benchmarks")
        if benchmarks not in sys.path:
            sys.path.insert(0, benchmarks)
        from common import OpCounter

        super().__init__()
        self.reads, self.counter = 0, OpCounter()

    def __enter__(self):
        self.counter.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.counter.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", None) in self.READS
        return func(*args, **(kwargs or {}))


def test_a_call_reads_the_device_once_and_inputs_that_fill_their_bucket_are_not_padded():
    """Outside its graph a call reads its token range and whether its mask pads a row in one
    device-to-host transfer, and inputs that fill their bucket go to the graph as they are:
    their only copy is the graph's own (the ids; the mask too where a row is padded)."""
    compiled = rbcompile.compile(make_tiny_model("llama"))
    compiled.use_cuda_graphs(capture=lambda run, inputs: ((lambda: None), run(*inputs)),
                             batch_buckets=(2,), seq_multiple=16)  # replays compute nothing
    ids = torch.randint(3, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    for mask, copies in ((torch.ones_like(ids), 1), (padded, 2)):
        expected = compiled(ids, mask)["logits"]                  # captured
        work = HostWork()
        with work:
            got = compiled(ids, mask)["logits"]                   # replayed
        assert compiled.cuda_graphs.stats.replays >= 1 and torch.equal(got, expected)
        assert work.reads == 1
        assert work.counter.ops["aten.copy_.default"] == copies
        assert not {"aten.new_zeros.default", "aten.fill_.Scalar"} & set(work.counter.ops)


def test_pooled_outputs_are_cut_back_by_batch_only():
    """The artifact knows which outputs have a sequence axis (the IR's `sequence_outputs`), so
    a pooled output as wide as the padded length is not cut back as if it were per token."""
    model = make_tiny_model("bert")                                  # hidden size 32
    compiled = rbcompile.compile(model)
    assert compiled.ir["sequence_outputs"] == ["last_hidden_state"]
    compiled.use_cuda_graphs(capture=FakeCapture(), batch_buckets=(4,), seq_multiple=32)
    ids = torch.randint(3, TINY_VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    got, expected = compiled(ids), model(input_ids=ids)
    for name in ("last_hidden_state", "pooler_output"):
        assert got[name].shape == expected[name].shape
        assert (got[name] - expected[name]).abs().max().item() <= 1e-5


def test_plan_graphs_are_captured_per_plan(compiled_tiny):
    """CUDA graphs over one compiled function per plan (plan_graphs.py, run eagerly here): each
    (plan, bucket) is captured once and replays the plan's function; the outputs equal the
    region interpreter's (within fp32 reordering)."""
    compiled = unguarded(rbcompile.compile(make_tiny_model("llama")))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, TINY_VOCAB, (2, 10), generator=generator)
    mask = torch.ones_like(ids)
    expected = {b: compiled(ids, mask, budget=b)["logits"] for b in (None, 0.5)}
    plans = compiled.compile_plans(max_plans=2).plan_graphs
    plans.compiler = lambda fn: fn
    compiled.use_cuda_graphs(capture=FakeCapture(), batch_buckets=(2,), seq_multiple=16)
    for budget in (None, 0.5, None, 0.5):
        got = compiled(ids, mask, budget=budget)["logits"]  # padded to 16: other matmul shapes
        assert (got - expected[budget]).abs().max().item() <= 1e-5
    assert compiled.cuda_graphs.stats.captures == 2 and compiled.cuda_graphs.stats.replays == 4
    assert plans.stats.compiles == 2


def test_cuda_graphs_need_cuda():
    compiled = rbcompile.compile(make_tiny_model("gpt2"))
    if not torch.cuda.is_available():
        with pytest.raises(rbcompile.UserError, match="need the model on a CUDA device"):
            compiled.use_cuda_graphs()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("command", [
    ["bash", "benchmarks/gpu_check.sh", "{tmp}/out"],
    [sys.executable, "benchmarks/bench_gpu.py", "--out", "{tmp}/out"],
], ids=["gpu_check", "bench_gpu"])
def test_gpu_scripts_refuse_without_cuda_in_one_line(tmp_path, command):
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([part.format(tmp=tmp_path) for part in command], cwd=root,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], result.stderr
    assert not (tmp_path / "out" / "bench_gpu.json").exists()


def _bench_gpu():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    return bench_gpu


def test_bench_gpu_profiles_device_time_by_kind_of_kernel():
    """bench_gpu's --profile: kernel names sorted into kinds, and one call's time summed by kind
    and by name (on CPU: its ops' self time)."""
    bench_gpu = _bench_gpu()
    kinds = {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>": "attention",
             "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
             "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
             "triton_poi_fused__to_copy_add_mul_0": "inductor triton",
             "_rms_norm_kernel": "rbcompile triton", "Memcpy DtoD (Device -> Device)": "copy",
             "void at::native::vectorized_elementwise_kernel<4, at::native::silu>": "other"}
    assert {name: bench_gpu.kernel_kind(name) for name in kinds} == kinds
    q, weight = torch.randn(1, 2, 64, 16), torch.randn(256, 256)
    x = torch.randn(64, 256)
    profile = bench_gpu.kernel_profile(
        lambda: (torch.nn.functional.scaled_dot_product_attention(q, q, q), x @ weight, x @ weight),
        torch.device("cpu"))
    assert {"gemm", "attention"} <= set(profile["by_kind_ms"]) and profile["events"] >= 3
    assert profile["total_ms"] == pytest.approx(sum(profile["by_kind_ms"].values()), rel=1e-3)
    assert ["aten::mm", 2] == profile["top"][[row[0] for row in profile["top"]].index("aten::mm")][:2]


def test_bench_gpu_checks_the_issues_targets_on_the_best_rows_with_parity():
    """bench_gpu's targets: per target the fastest rbcompile row at its budget (a full path
    only with parity) against the fastest reference row; missing rows leave it unmeasured."""
    def row(contender, ms, budget=0.0, **fields):
        return {"contender": contender, "ms": ms, "budget": budget, **fields}
    results = {"cases": {
        "bert": {"rows": [row("inductor", 5.0), row("inductor-ro", 2.4),
                          row("rbc-graphs", 2.45, parity=True),
                          row("rbc-ind-graphs", 2.0, parity=False),      # fastest, but wrong
                          row("rbc-graphs", 1.8, budget=0.25, top1_agreement=0.2),
                          {"contender": "rbc-k-graphs", "error": "RuntimeError: boom"}]},
        "llama1b": {"rows": [row("inductor", 20.0)]},                     # no rbcompile row
        "smol-decode": {"rows": [row("inductor-ro", 390.0, tokens_per_s=328.0),
                                 row("rbc-generate", 300.0, tokens_per_s=427.0)]}}}
    checks = {(c["case"], c["budget"]): c for c in _bench_gpu().target_checks(results)}
    full = checks[("bert", 0.0)]
    assert (full["rbcompile"], full["reference"]) == ("rbc-graphs", "inductor-ro")
    assert full["speedup"] == pytest.approx(2.4 / 2.45) and full["met"]      # within 1.05x
    light = checks[("bert", 0.25)]
    assert light["speedup"] == pytest.approx(2.4 / 1.8) and light["met"]     # >= 1.25x
    assert checks[("llama1b", 0.0)]["met"] is None
    decode = checks[("smol-decode", 0.0)]
    assert decode["met"] and decode["speedup"] == pytest.approx(390 / 300)
    results["cases"]["bert"]["rows"][2]["ms"] = 2.6                          # 0.92x: missed
    assert _bench_gpu().target_checks(results)[0]["met"] is False
