"""The fuse_kernels pass: which ops it leaves in the graph, parity of fused modules with eager,
artifacts and ONNX export of fused modules, and the torch.compile backend with kernels."""
import pytest
import torch

import rbcompile

from conftest import TINY_VOCAB, eager_outputs, make_tiny_model, max_diff, unguarded

# arch -> (ops the pass must add, ops it must remove entirely)
EXPECTED = {
    "llama": ({"rbcompile.rms_norm.default", "rbcompile.swiglu.default",
               "rbcompile.rotary_pair.default"},  # q's and k's rotary in one op
              {"aten.rsqrt.default", "aten.silu.default", "aten.neg.default",
               "rbcompile.rotary.default"}),
    "gpt2": ({"rbcompile.layer_norm.default", "rbcompile.gelu_bias.default"},
             {"aten.layer_norm.default", "aten.tanh.default", "aten.pow.Tensor_Scalar"}),
    "bert": ({"rbcompile.add_layer_norm.default", "rbcompile.gelu_bias.default"},
             {"aten.layer_norm.default", "aten.gelu.default"}),
}


def _inputs(batch=2, seq=9):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, TINY_VOCAB, (batch, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    return ids, mask


def _ops(compiled) -> set[str]:
    return {node[1] for node in compiled.ir["nodes"]}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_pass_replaces_patterns_with_kernel_ops(fused_tiny, arch):
    compiled, _ = fused_tiny[arch]
    present, absent = EXPECTED[arch]
    ops = _ops(compiled)
    assert present <= ops
    assert not (absent & ops)
    (entry,) = [p for p in compiled.manifest["passes"] if p["pass"] == "fuse_kernels"]
    assert entry["changed"] and entry["stats"]


def test_pass_is_off_by_default(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    assert not any(op.startswith("rbcompile.") for op in _ops(compiled))
    assert "aten.rsqrt.default" in _ops(compiled)


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_fused_full_path_matches_eager_and_gates_still_skip(fused_tiny, arch):
    compiled, eager = fused_tiny[arch]
    ids, mask = _inputs()
    assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
    light = compiled(ids, mask, budget=0.5)
    assert light.skipped_flops > 0
    plain = unguarded(rbcompile.compile(eager))
    assert max_diff(light, plain(ids, mask, budget=0.5)) <= 1e-5


def test_fused_artifact_round_trips(fused_tiny, tmp_path):
    """BERT's q / k / v, stacked with their biases, are stacked again at load."""
    from rbcompile.artifact.module import stacks

    compiled, eager = fused_tiny["bert"]
    loaded = rbcompile.load(compiled.save(tmp_path / "fused"))
    assert "import rbcompile.kernels" in loaded.source
    assert len(stacks(loaded.module)) == 2 * eager.config.num_hidden_layers   # weights, biases
    ids, mask = _inputs()
    assert torch.equal(loaded(ids, mask)["last_hidden_state"], compiled(ids, mask)["last_hidden_state"])


def test_fused_module_exports_to_onnx(fused_tiny, tmp_path):
    from rbcompile.frontend.onnx_export import OnnxRunner, export_onnx

    compiled, _ = fused_tiny["llama"]
    report = export_onnx(compiled, tmp_path / "fused.onnx", validate=False)
    runner = OnnxRunner(compiled, report.path)
    ids, mask = _inputs()
    real = mask.bool()  # padded positions hold unspecified values in both engines
    expected = compiled(ids, mask)["logits"][real]
    got = runner(ids, mask)["logits"][real]
    assert (expected - got).abs().max().item() <= 1e-4


def test_backend_with_kernels_matches_eager():
    from rbcompile.frontend import backend

    torch._dynamo.reset()
    backend.reset()
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile",
                             options={"strict": True, "regions": "eager", "kernels": True})
    ids, mask = _inputs()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
    assert (expected - got).abs().max().item() <= 1e-5
    (graph,) = backend.compiled_graphs()
    assert graph.handled_by == "rbcompile"
    (fused,) = [p for p in graph.passes if p["pass"] == "fuse_kernels"]
    assert fused["stats"].get("rms_norm", 0) >= 8 and fused["stats"].get("swiglu") == 4
    assert fused["stats"].get("rotary") == 8  # q and k of 4 layers, on aot_autograd's graph too
    assert fused["stats"].get("rotary_pair") == 4
    torch._dynamo.reset()


@pytest.mark.real
def test_smollm2_fused_matches_eager():
    """Real weights: SmolLM2-135M cut to its first 4 of 30 layers (the trained norms, SwiGLU
    and head; the whole model's compile costs half a minute more), fused, equals eager."""
    from transformers import AutoTokenizer

    from rbcompile.artifact.models import load_hf_model, resolve_checkpoint

    path = resolve_checkpoint("smollm2-135m")
    eager = load_hf_model(path)
    eager.model.layers = eager.model.layers[:4]
    eager.config.num_hidden_layers = 4
    batch = AutoTokenizer.from_pretrained(path)(
        ["The capital of France is", "Emma Woodhouse, handsome, clever, and rich"],
        return_tensors="pt", padding=True)
    expected = eager_outputs(eager, batch["input_ids"], batch["attention_mask"])
    compiled = rbcompile.compile(eager, kernels=True)
    assert {"rbcompile.rms_norm.default", "rbcompile.swiglu.default"} <= _ops(compiled)
    assert max_diff(compiled(batch["input_ids"], batch["attention_mask"]), expected) <= 1e-5


def test_calibrated_width_levels_are_fused_too(tiny_checkpoints, calib_file):
    from rbcompile.artifact.models import load_hf_model

    compiled = rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=8,
                                 calib_seq=32, kernels=True, calib_budgets=[0.25])
    variant_ops = {node[1] for variant in compiled.ir["variants"] for node in variant["nodes"]}
    assert "rbcompile.swiglu.default" in variant_ops
    eager = load_hf_model(tiny_checkpoints["llama"])
    ids, mask = _inputs()
    assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
    light = compiled(ids, mask, budget=0.25)["logits"]  # seams where both sides run full width
    compiled.module.fuse_seams = False
    assert torch.equal(compiled(ids, mask, budget=0.25)["logits"], light)
    narrow = compiled(ids, mask, widths=[0.5] * compiled.num_gates)
    assert narrow.skipped_flops > 0


def test_the_kv_cached_decoder_is_fused_and_generates_hf_tokens(fused_tiny):
    """The decoder graph (prefill and decode steps with a static cache) gets the same kernels:
    norms and SwiGLU fused, and each layer's q / k rotaries and K / V cache writes one op (k
    rotated straight into the cache); greedy tokens equal transformers'."""
    from shared import DECODER_PROMPTS, hf_new_tokens

    compiled, eager = fused_tiny["llama"]
    ops = [node[1] for node in compiled.decoder.ir["nodes"]]
    assert "rbcompile.swiglu.default" in ops
    assert not set(ops) & {"aten.neg.default", "aten.rsqrt.default", "aten.silu.default",
                           "aten.index_copy_.default", "rbcompile.rotary_pair.default",
                           "rbcompile.write_kv.default"}
    assert ops.count("rbcompile.rotary_write_kv.default") == compiled.decoder.shape.layers
    mask = (DECODER_PROMPTS != 0).long()
    assert (compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=8).tokens
            == hf_new_tokens(eager, DECODER_PROMPTS, mask, 8))


def _rotary_then_write(q_read_first=False, k_read_too=False, write_region=0):
    """A layer's step graph: `rotary_pair` then `write_kv` of the rotated k and v, then q read;
    optionally q also read before the write, the rotated k also read elsewhere, the write in
    another region than the rotary."""
    import operator

    from rbcompile.kernels import OPS
    from rbcompile.passes.base import REGION

    graph = torch.fx.Graph()
    key_cache, value_cache, position, q, k, v, cos, sin = (
        graph.placeholder(name) for name in ("key_cache", "value_cache", "position", "q", "k", "v",
                                             "cos", "sin"))
    pair = graph.call_function(OPS.rotary_pair.default, (q, k, cos, sin))
    q_rotated, k_rotated = (graph.call_function(operator.getitem, (pair, i)) for i in (0, 1))
    outputs = [graph.call_function(torch.ops.aten.mul.Tensor, (q_rotated, 2.0))] if q_read_first else []
    write = graph.call_function(OPS.write_kv.default, (key_cache, value_cache, position, k_rotated, v))
    outputs.append(graph.call_function(torch.ops.aten.add.Tensor, (q_rotated, 1.0)))
    if k_read_too:
        outputs.append(graph.call_function(torch.ops.aten.add.Tensor, (k_rotated, 1.0)))
    graph.output(tuple(outputs))
    for node in graph.nodes:
        node.meta[REGION] = write_region if node is write else 0
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _step_inputs():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 3, 8, generator=generator) for heads in (6, 2, 2))
    cos, sin = (torch.randn(1, 1, 3, 8, generator=generator) for _ in range(2))
    caches = [torch.randn(2, 2, 7, 8, generator=generator) for _ in range(2)]
    return [*caches, torch.tensor([4, 0, 5]), q, k, v, cos, sin]


@pytest.mark.parametrize("case, fused", [({}, True), ({"q_read_first": True}, False),
                                         ({"k_read_too": True}, False),
                                         ({"write_region": 1}, False)],
                         ids=["fused", "q-read-before-the-write", "k-read-elsewhere",
                              "two-regions"])
def test_a_rotary_pair_and_its_cache_write_become_one_op_only_where_that_keeps_the_order(case, fused):
    """`rotary_write_kv` replaces a rotary pair and the cache write of its rotated k when the
    write is the rotated k's only reader, nothing reads the rotated q before the write, and
    both lie in one region; the outputs and the caches are those of the graph before."""
    from rbcompile.passes.fuse_kernels import _Fuser

    gm = _rotary_then_write(**case)
    before, after = _step_inputs(), _step_inputs()
    want = gm(*before)
    fuser = _Fuser(gm)
    fuser.rotate_into_cache_writes()
    gm.graph.lint()
    gm.recompile()
    targets = {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
    assert ("rbcompile.rotary_write_kv.default" in targets) == fused, targets
    assert ("rbcompile.write_kv.default" in targets) != fused
    got = gm(*after)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(after[:2], before[:2]))


def test_a_partial_rotary_is_fused_and_matches_eager():
    """Phi-3 with `partial_rotary_factor=0.5` rotates a slice of each head (and concatenates
    the rest back): the slices' rotaries are fused (q's and k's in one op), the full path still
    equals eager."""
    from test_architectures import _extra_config
    from transformers import AutoModelForCausalLM

    config = _extra_config("phi3")
    config.rope_parameters["partial_rotary_factor"] = 0.5
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config).eval()
    assert eager.model.rotary_emb.inv_freq.numel() * 4 == config.hidden_size // config.num_attention_heads
    compiled = rbcompile.compile(eager, kernels=True)
    assert "rbcompile.rotary_pair.default" in _ops(compiled)
    assert not {"aten.neg.default", "rbcompile.rotary.default"} & _ops(compiled)
    ids, mask = _inputs()
    assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
