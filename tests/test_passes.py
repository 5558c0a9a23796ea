"""Graph contents after the passes, the pass contracts and the debug dump."""
import pytest
import torch

from conftest import make_tiny_model
from rbcompile.passes import PIPELINE, PassContext, run_pipeline
from rbcompile.passes.base import KIND, REGION, UNIT, compute_nodes, module_path
from rbcompile.architectures import lookup
from rbcompile.trace import example_inputs, trace

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
