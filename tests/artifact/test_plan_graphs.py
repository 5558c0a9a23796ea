"""One compiled graph per plan (rbcompile/artifact/plan_graphs.py): the plan's straight-line source, its
equality with the region interpreter, the bound on kept plans, and inductor through the
artifact, its KV-cached decoder and the torch.compile backend."""
import gc
import itertools
import linecache
import logging

import pytest
import torch

import rbcompile
from rbcompile.artifact.plan_graphs import PlanGraphs, compile_plans
from rbcompile.artifact.regions import plan_steps

from conftest import eager_outputs, make_tiny_model, max_diff, random_batch, unguarded


def _eagerly(fn):
    return fn


def test_plan_source_is_one_line_per_step(fused_tiny):
    module = fused_tiny["llama"][0].module
    gates = [True, False] * 4
    source = PlanGraphs(module, ["linear_28"]).source(gates)
    steps = plan_steps(module, gates)
    assert source.startswith("def plan(self, input_ids, attention_mask):")
    assert source.count("self.r") == sum(step.method is not None for step in steps)
    assert source.count("skipped") == 4
    assert "run_regions" not in source and source.rstrip().endswith("return (linear_28,)")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_plan_function_equals_the_interpreter(arch):
    compiled = rbcompile.compile(make_tiny_model(arch), kernels=arch == "llama")
    module = compiled.module
    ids, mask = random_batch(2, 9)
    plans = list(itertools.product([True, False], repeat=module.NUM_GATES))
    with torch.no_grad():
        expected = [module(ids, mask, list(gates)) for gates in plans]
    graphs = compile_plans(module, compiled.ir, max_plans=len(plans), compiler=_eagerly)
    for gates, outputs in zip(plans, expected):
        got = module(ids, mask, list(gates))
        assert all(torch.equal(a, b) for a, b in zip(got, outputs)), gates
    assert graphs.stats.compiles == len(plans) == len(graphs)


def test_width_levels_run_in_the_plan_function(calibrated_tiny):
    compiled = calibrated_tiny["llama"]
    ids, mask = random_batch(2, 9)
    gates, widths = [True] * compiled.num_gates, [0.5] * compiled.num_gates
    with torch.no_grad():
        expected = compiled.module(ids, mask, gates, widths)
    graphs = compile_plans(compiled.module, compiled.ir, compiler=_eagerly)
    try:
        assert "_w" in graphs.source(gates, widths)  # the narrowed methods
        got = compiled.module(ids, mask, gates, widths=widths)
    finally:
        del compiled.module.forward
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_kept_plans_are_bounded_least_recently_used_first():
    compiled = rbcompile.compile(make_tiny_model("llama"))
    graphs = compile_plans(compiled.module, compiled.ir, max_plans=2, compiler=_eagerly)
    ids, mask = random_batch(1, 5)
    full, light, lighter = [True] * 8, [True] * 7 + [False], [False] * 8
    for gates in (full, light, full, lighter):
        compiled.module(ids, mask, gates)
    assert graphs.stats.compiles == 3 and graphs.stats.evictions == 1
    assert [key[0] for key in graphs.keys()] == [tuple(full), tuple(lighter)]
    with pytest.raises(ValueError, match="max_plans"):
        PlanGraphs(compiled.module, ["x"], max_plans=0)


def test_a_plan_the_compiler_fails_on_runs_through_the_interpreter(caplog):
    compiled = rbcompile.compile(make_tiny_model("llama"))
    module = compiled.module
    ids, mask = random_batch(2, 9)
    gates = [True, False] * 4
    with torch.no_grad():
        expected = module(ids, mask, gates)

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no code for this graph")

    torch._dynamo.reset()
    graphs = compile_plans(module, compiled.ir,
                           compiler=lambda fn: torch.compile(fn, backend=failing_backend))
    with caplog.at_level(logging.WARNING, logger="rbcompile.artifact.plan_graphs"):
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(module(ids, mask, gates), expected))
    assert graphs.stats.failures == 1 and graphs.stats.compiles == 1 and graphs.stats.calls == 2
    assert "the compiler failed" in caplog.text and "region interpreter" in caplog.text
    torch._dynamo.reset()
    graphs = compile_plans(module, compiled.ir, compiler=_eagerly)  # other errors are raised
    with pytest.raises(RuntimeError):
        module(ids[:, :4], mask, gates)
    assert graphs.stats.failures == 0


@pytest.mark.parametrize("unit", ["plan", "region"])
def test_a_first_compile_is_static_whatever_another_module_saw(unit):
    """Dynamo keeps what it learnt of a function's shapes by file name, line and name: two
    modules generated alike, run at other shapes, must not make each other's plans (or
    regions, compile_regions) compile dynamic on their first call."""
    dynamic_inputs = []

    def recording(gm, example_inputs):
        dynamic_inputs.append([node.name for node in gm.graph.nodes if node.op == "placeholder"
                               and isinstance(node.meta.get("example_value"), torch.SymInt)])
        return gm.forward

    torch._dynamo.reset()
    for seq in (9, 5):
        compiled = rbcompile.compile(make_tiny_model("llama"))
        module, (ids, mask) = compiled.module, random_batch(2, seq)
        if unit == "plan":
            compile_plans(module, compiled.ir,
                          compiler=lambda fn: torch.compile(fn, backend=recording))
        else:
            name = module.REGIONS[1].methods[0]
            setattr(module, name, torch.compile(getattr(module, name), backend=recording))
        with torch.no_grad():
            module(ids, mask, [True] * 8)
    assert dynamic_inputs == [[], []]


def test_generated_sources_are_readable_while_their_module_lives():
    before = set(linecache.cache)
    compiled = rbcompile.compile(make_tiny_model("llama"))
    compile_plans(compiled.module, compiled.ir, compiler=_eagerly)
    compiled.module(*random_batch(2, 5), [True] * 8)
    shown = {name for name in set(linecache.cache) - before if name.startswith("<rbcompile")}
    assert len(shown) == 3 and any("plan 0" in name for name in shown)  # model, decoder, plan
    del compiled
    gc.collect()
    assert not [name for name in linecache.cache if name in shown]


def test_inductor_plan_graphs_match_eager_in_the_artifact(tiny_checkpoints):
    compiled = unguarded(rbcompile.compile(tiny_checkpoints["llama"], kernels=True))
    eager = make_tiny_model("llama")
    ids, mask = random_batch(2, 9)
    light = compiled(ids, mask, budget=0.5)["logits"]
    compiled.compile_plans(max_plans=4)
    assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
    assert (compiled(ids, mask, budget=0.5)["logits"] - light).abs().max().item() <= 1e-5
    assert compiled.plan_graphs.stats.compiles == 2 and compiled.plan_graphs.stats.failures == 0


@pytest.mark.xfail(torch.__version__ < "2.13", strict=True, reason="torch 2.11 and 2.12's CPU "
                   "inductor cannot compile the decoder's causal mask at dynamic shapes (a C++ "
                   "code generation error); the plan runs through the interpreter instead")
def test_inductor_plan_graphs_keep_the_decoders_tokens(tiny_checkpoints):
    """Prompts of two lengths: the second recompiles the plans at dynamic shapes. Compiled as on
    CUDA (kernels, stacked projections: inductor reads weights that are views of one stack)."""
    compiled = rbcompile.compile(tiny_checkpoints["llama"], kernels=True, stack_projections=True)
    prompts = [torch.tensor([[1, 5, 9, 14, 22, 31]]), torch.tensor([[7, 3, 11, 2]])]
    tokens = [compiled.generate(prompt, max_new_tokens=6).tokens for prompt in prompts]
    compiled.compile_plans(max_plans=4)
    assert [compiled.generate(prompt, max_new_tokens=6).tokens for prompt in prompts] == tokens
    # one plan function for the prefills (from the first slot, no padding: no mask), one for
    # the decode steps
    assert compiled.decoder.plan_graphs.stats.compiles == 2
    assert compiled.decoder.plan_graphs.stats.failures == 0


def test_backend_runs_one_graph_per_plan():
    from rbcompile.frontend import backend

    torch._dynamo.reset()
    backend.reset()
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options={"strict": True,
                                                                 "regions": "plan"})
    ids, mask = random_batch(2, 9)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
        with backend.decision(budget=0.5):
            compiled(ids, attention_mask=mask, use_cache=False)
    assert (expected - got).abs().max().item() <= 1e-5
    (graph,) = backend.compiled_graphs()
    assert graph.handled_by == "rbcompile" and graph.calls == 2
    torch._dynamo.reset()
