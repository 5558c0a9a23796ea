"""Graph contents after the passes, the pass contracts and the debug dump."""
import pytest
import torch
from torch.utils._pytree import tree_leaves

from rbcompile.artifact.architectures import lookup
from rbcompile.compiler.trace import example_inputs, trace
from rbcompile.passes import PIPELINE, PassContext, run_pipeline
from rbcompile.passes.base import KIND, REGION, UNIT, compute_nodes, module_path

from conftest import make_tiny_model

aten = torch.ops.aten


def _run(arch: str, passes=PIPELINE, **ctx_kwargs):
    model = make_tiny_model(arch)
    architecture = lookup(model.config)
    traced = trace(model, architecture)
    reference = example_inputs(architecture, model.config.vocab_size, batch=1, seq=16)
    ctx = PassContext(family=architecture.family, input_names=traced.input_names,
                      reference_inputs=reference, architecture=architecture,
                      dims=architecture.dimensions(model.config), **ctx_kwargs)
    run_pipeline(traced.graph_module, ctx, passes)
    return traced.graph_module, ctx


@pytest.fixture(scope="module")
def llama():
    return _run("llama")


def test_every_llama_layer_has_prunable_layer_attention_and_mlp(llama):
    gm, ctx = llama
    layers = ctx.dims.layers
    units = {(u.layer, u.kind): u for u in ctx.units}
    assert set(units) == {(i, k) for i in range(layers) for k in ("attention", "mlp")}
    for node in compute_nodes(gm):
        path = module_path(node)
        if path.startswith("model.layers."):
            index = int(path.split(".")[2])
            branch = "self_attn" if ".self_attn" in path or "input_layernorm" in path else "mlp"
            if path == f"model.layers.{index}":  # the residual adds themselves
                continue
            assert node.meta[KIND] == "prunable", node
            assert node.meta[UNIT] == f"model.layers.{index}.{branch}", node
    # the residual adds are the branch outputs, and a layer is its two branches
    for i in range(layers):
        attn, mlp = units[(i, "attention")], units[(i, "mlp")]
        assert attn.stream_out.target is aten.add.Tensor and mlp.stream_in is attn.stream_out
        assert module_path(mlp.stream_out) == f"model.layers.{i}"


def test_embeddings_final_norm_and_head_are_skeleton(llama):
    gm, _ = llama
    kinds = {}
    for node in compute_nodes(gm):
        path = module_path(node)
        for prefix in ("model.embed_tokens", "model.norm", "lm_head"):
            if path.startswith(prefix):
                kinds.setdefault(prefix, set()).add(node.meta[KIND])
    assert kinds == {p: {"skeleton"} for p in ("model.embed_tokens", "model.norm", "lm_head")}
    embedding = [n for n in compute_nodes(gm) if n.target is aten.embedding.default]
    assert [n.meta[KIND] for n in embedding] == ["skeleton"]


def test_rotary_tables_and_mask_are_cache_reuse(llama):
    gm, ctx = llama
    cache_ops = {n.target for n in compute_nodes(gm) if n.meta[KIND] == "cache"}
    assert {aten.cos.default, aten.sin.default, aten.arange.default} <= cache_ops
    assert aten.linear.default not in cache_ops and aten.embedding.default not in cache_ops
    (cache_region,) = [r for r in ctx.regions if r["kind"] == "cache"]
    assert "attention_mask" in cache_region["inputs"]
    assert len(ctx.cache_candidates["prefix_kv"]) == ctx.dims.layers


def test_regions_are_contiguous_and_ordered(llama):
    gm, ctx = llama
    ids = [n.meta[REGION] for n in compute_nodes(gm)]
    assert ids == sorted(ids) and set(ids) == set(range(len(ctx.regions)))
    prunable = [r for r in ctx.regions if r["kind"] == "prunable"]
    assert [r["gate"] for r in prunable] == list(range(len(prunable)))
    assert abs(sum(r["prunable_share"] for r in prunable) - 1) < 1e-9
    for region in prunable:
        (out, stream_in), = region["skip"].items()
        assert region["outputs"] == [out] and stream_in in region["inputs"]


def test_canonicalize_removes_asserts_and_identities(llama):
    gm, ctx = llama
    targets = {n.target for n in compute_nodes(gm)}
    assert not targets & {aten._assert_tensor_metadata.default, aten.alias.default,
                          aten.dropout.default}
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "attention_mask"]
    assert [h["pass"] for h in ctx.history] == [p.pass_name for p in PIPELINE]


@pytest.mark.parametrize("arch,kinds", [("gpt2", {"attention", "mlp"}), ("bert", {"layer"})])
def test_pre_ln_gpt2_splits_branches_post_ln_bert_keeps_layers(arch, kinds):
    _, ctx = _run(arch)
    assert {u.kind for u in ctx.units} == kinds
    assert len({u.layer for u in ctx.units}) == ctx.dims.layers


def test_width_units_are_recorded(llama):
    _, ctx = llama
    attn = next(u for u in ctx.units if u.kind == "attention")
    mlp = next(u for u in ctx.units if u.kind == "mlp")
    assert (attn.width["heads"], attn.width["kv_heads"], attn.width["head_dim"]) == (4, 2, 8)
    assert any(p.endswith("q_proj.weight") for p in attn.width["parameters"])
    assert mlp.width["channels"] == 48
    assert any(p.endswith("down_proj.weight") for p in mlp.width["parameters"])


def test_pipeline_checks_requirements():
    with pytest.raises(AssertionError, match="requires"):
        _run("llama", passes=[p for p in PIPELINE if p.pass_name != "discover_blocks"])


def test_debug_switch_dumps_graph_before_and_after(tmp_path):
    _run("gpt2", dump_pass="canonicalize", dump_dir=str(tmp_path))
    before = (tmp_path / "canonicalize.before.txt").read_text()
    after = (tmp_path / "canonicalize.after.txt").read_text()
    assert "_assert_tensor_metadata" in before and "_assert_tensor_metadata" not in after


_ATTENTIONS = (aten.scaled_dot_product_attention.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default)


def _attention_masks(gm) -> list:
    return [n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            for n in compute_nodes(gm) if n.target in _ATTENTIONS]


@pytest.mark.parametrize("model_type,masks", [("llama", 1), ("gemma3_text", 2)])
def test_attentions_share_one_additive_mask_per_mask(model_type, masks):
    """Every layer's attention read the same bool mask and converted it itself; now one
    `where(mask, 0, -inf)` per mask (Gemma 3: its sliding and its full one) is made once,
    and the graph's outputs are bitwise those before the pass."""
    from test_architectures import tiny_model

    from rbcompile.passes import canonicalize, gqa_attention, share_attention_masks

    model = tiny_model(model_type)
    architecture = lookup(model.config)
    traced = trace(model, architecture)
    gm = traced.graph_module
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ctx = PassContext(family=architecture.family, input_names=traced.input_names,
                      reference_inputs=example_inputs(architecture, model.config.vocab_size))
    run_pipeline(gm, ctx, [canonicalize, gqa_attention])
    before = torch.fx.Interpreter(gm).run(ids, mask)
    assert all(m.meta["val"].dtype == torch.bool for m in _attention_masks(gm))
    run_pipeline(gm, ctx, [share_attention_masks])
    shared = set(_attention_masks(gm))
    assert len(shared) == masks and len(_attention_masks(gm)) == model.config.num_hidden_layers
    for additive in shared:
        assert additive.target is aten.where.self and additive.meta["val"].dtype == torch.float32
        assert [a.args[0] for a in additive.args[1:]] == [0.0, float("-inf")]
    assert sum(n.target is aten.where.self for n in compute_nodes(gm)) == masks
    after = torch.fx.Interpreter(gm).run(ids, mask)
    for got, want in zip(tree_leaves(after), tree_leaves(before), strict=True):
        assert torch.equal(got, want)


def _grouped_reads(gm) -> list:
    return [n.kwargs.get("enable_gqa", False) for n in compute_nodes(gm) if n.target in _ATTENTIONS]


def test_grouped_kv_heads_are_read_in_place_traced_or_rewritten(monkeypatch):
    """A GQA Llama (4 query heads on 2 K/V heads): rbcompile's trace has every attention read
    the grouped K/V with enable_gqa (transformers' switch, `tracing_grouped_heads`), so
    `gqa_attention` finds no repeat_kv copy; traced without that switch (as dynamo's graphs
    are) the copies are there and the pass rewrites each of them (torch 2.11 traces them with
    a slice over a whole dimension more, which the pass missed). Both graphs compute the same
    outputs, bitwise."""
    import contextlib

    import rbcompile.compiler.trace as trace_module
    from rbcompile.passes import canonicalize, gqa_attention

    model = make_tiny_model("llama")
    architecture = lookup(model.config)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    layers = model.config.num_hidden_layers

    def traced_and_rewritten():
        traced = trace(model, architecture)
        ctx = PassContext(family=architecture.family, input_names=traced.input_names,
                          reference_inputs=example_inputs(architecture, model.config.vocab_size))
        history = run_pipeline(traced.graph_module, ctx, [canonicalize])
        grouped = _grouped_reads(traced.graph_module)
        history = run_pipeline(traced.graph_module, ctx, [gqa_attention])
        rewritten = history[-1]["stats"]["rewritten"]
        outputs = torch.fx.Interpreter(traced.graph_module).run(ids, mask)
        assert _grouped_reads(traced.graph_module) == [True] * layers
        return grouped, rewritten, outputs

    grouped, rewritten, outputs = traced_and_rewritten()
    assert grouped == [True] * layers and rewritten == 0
    monkeypatch.setattr(trace_module, "tracing_grouped_heads", contextlib.nullcontext)
    grouped, rewritten, copied_then_rewritten = traced_and_rewritten()
    assert grouped == [False] * layers and rewritten == layers
    for got, want in zip(tree_leaves(outputs), tree_leaves(copied_then_rewritten), strict=True):
        assert torch.equal(got, want)


def test_grouped_kv_heads_are_read_in_place_on_cuda_too(monkeypatch):
    """The graph reads grouped K/V heads in place whatever its device (the generated module
    picks the form per call: rbcompile/artifact/attention.py): the pass rewrites the copies in a graph
    whose attention reads CUDA tensors (fake ones here), and the trace's switch takes grouped
    heads on CUDA as on CPU."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.integrations import sdpa_attention

    import rbcompile.compiler.trace as trace_module
    from rbcompile.passes import canonicalize, gqa_attention

    model = make_tiny_model("llama")
    architecture = lookup(model.config)
    tracing_grouped_heads = trace_module.tracing_grouped_heads
    monkeypatch.setattr(trace_module, "tracing_grouped_heads", contextlib.nullcontext)
    traced = trace(model, architecture)   # with the copies, as transformers makes them on CUDA
    ctx = PassContext(family=architecture.family, input_names=traced.input_names,
                      reference_inputs=example_inputs(architecture, model.config.vocab_size))
    run_pipeline(traced.graph_module, ctx, [canonicalize])
    with FakeTensorMode():
        for node in compute_nodes(traced.graph_module):
            if node.target in _ATTENTIONS:
                query = node.args[0]
                query.meta["val"] = torch.empty(query.meta["val"].shape, device="cuda")
    history = run_pipeline(traced.graph_module, ctx, [gqa_attention])
    assert history[-1]["stats"]["rewritten"] == model.config.num_hidden_layers
    assert _grouped_reads(traced.graph_module) == [True] * model.config.num_hidden_layers
    with FakeTensorMode():
        key = torch.empty(1, 2, 5, 8, device="cuda")
        mask = torch.empty(1, 1, 1, 5, device="cuda")
        assert not sdpa_attention.use_gqa_in_sdpa(mask, key, key)   # transformers' own choice
        with tracing_grouped_heads():
            assert sdpa_attention.use_gqa_in_sdpa(mask, key, key)
        assert not sdpa_attention.use_gqa_in_sdpa(mask, key, key)


def test_the_backends_decomposed_attentions_share_their_mask_conversion():
    """aot_autograd decomposes each attention with its own `where(mask, 0, -inf)`: the later
    ones are replaced by one made where the mask is."""
    from rbcompile.frontend import backend

    from conftest import TINY_VOCAB

    torch._dynamo.reset()
    backend.reset()
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options={"strict": True,
                                                                 "regions": "eager"})
    ids = torch.randint(3, TINY_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
    assert (got - expected).abs().max().item() <= 1e-5
    (graph,) = backend.compiled_graphs()
    (entry,) = [p for p in graph.passes if p["pass"] == "share_attention_masks"]
    assert entry["stats"] == {"attentions": model.config.num_hidden_layers, "masks": 1}
    torch._dynamo.reset()


class _Projections(torch.nn.Module):
    """q / k / v of one input (v flattened: its view merges the last dimension), a biased
    pair of another, and a projection alone."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, n, bias=False) for n in (8, 4, 4))
        self.a, self.b = torch.nn.Linear(8, 6), torch.nn.Linear(8, 6)
        self.alone = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        q = self.q(x).view(2, 5, 2, 4).transpose(1, 2)
        k = self.k(x).view(2, 5, 1, 4).transpose(1, 2)
        v = self.v(x).view(2, 20)
        return q.sum(1) + k.sum(1), v, torch.nn.functional.silu(self.a(y)) * self.b(y), self.alone(x)


def test_projections_of_one_input_become_one_matmul_over_stacked_weights():
    """q and k (not v, whose view would merge the stacked dimension) and the biased pair
    become one linear each over stacked weights the context records; outputs hold."""
    from rbcompile.passes import fuse_projections

    torch.manual_seed(0)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    gm = torch.export.export(_Projections().eval(), (x, y)).module()
    for node in gm.graph.nodes:
        node.meta[REGION] = 0
    before = gm(x, y)
    ctx = PassContext(family="decoder", input_names=("x", "y"), reference_inputs={},
                      regions=[], fuse_projections=True)
    (entry,) = run_pipeline(gm, ctx, [fuse_projections])
    assert entry["stats"] == {"groups": 2, "matmuls_removed": 2}
    assert ctx.concatenated == {"q_k_weight": ["q.weight", "k.weight"],
                                "a_b_weight": ["a.weight", "b.weight"],
                                "a_b_bias": ["a.bias", "b.bias"]}
    linears = [n for n in compute_nodes(gm) if n.target is aten.linear.default]
    assert sorted(n.args[1].target for n in linears) == ["a_b_weight", "alone.weight",
                                                          "q_k_weight", "v.weight"]
    for got, want in zip(gm(x, y), before, strict=True):
        assert (got - want).abs().max().item() <= 1e-6
