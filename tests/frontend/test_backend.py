"""torch.compile(model, backend="rbcompile"): parity with eager, gates at call time, generate(),
graph breaks, fallback and strict mode, the entry point."""
import subprocess
import sys

import pytest
import torch

from rbcompile.frontend import backend

from conftest import TINY_VOCAB, make_tiny_model

STRICT_EAGER = {"strict": True, "regions": "eager"}
# the backend's plans are never measured: a lossy budget needs them allowed (rbcompile/artifact/guard.py)
LOSSY = {**STRICT_EAGER, "allow_unmeasured_plans": True}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    backend.reset()
    yield
    torch._dynamo.reset()


def _inputs(batch, seq, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY_VOCAB, (batch, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[-1, : seq // 3] = 0
    return ids, mask


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output.to_tuple()[0]


def _prunable_kinds(graph) -> list[str]:
    return sorted({r["unit_kind"] for r in graph.regions if r["kind"] == "prunable"})


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_parity_with_eager_on_two_shapes(arch):
    model = make_tiny_model(arch)
    compiled = torch.compile(model, backend="rbcompile", options=STRICT_EAGER)
    with torch.no_grad():
        for batch, seq in ((2, 8), (3, 13), (4, 5)):  # the second shape recompiles with SymInts
            ids, mask = _inputs(batch, seq)
            expected, got = _first(model(ids, attention_mask=mask)), _first(compiled(ids, attention_mask=mask))
            assert (expected - got).abs().max().item() <= 1e-5
    graphs = backend.compiled_graphs()
    assert [g.handled_by for g in graphs] == ["rbcompile", "rbcompile"]  # static, then dynamic
    assert graphs[1].calls == 2 and graphs[1].num_gates >= 4


_GLOBAL_MODEL = {}


def _through_a_global(ids, mask):
    return _GLOBAL_MODEL["llama"](ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("reached", ["global", "closure"])
def test_a_function_that_calls_the_model_is_compiled(monkeypatch, reached):
    """torch.compile of a function that calls the model: dynamo names its modules
    `G['_GLOBAL_MODEL']['llama']...` or `L['model']...`; the graph is compiled, not fallen back."""
    model = make_tiny_model("llama")
    monkeypatch.setitem(_GLOBAL_MODEL, "llama", model)

    def through_a_closure(ids, mask):
        return model(ids, attention_mask=mask, use_cache=False).logits

    function = _through_a_global if reached == "global" else through_a_closure
    compiled = torch.compile(function, backend="rbcompile", options=STRICT_EAGER)
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        assert (function(ids, mask) - compiled(ids, mask)).abs().max() <= 1e-5
    (graph,) = backend.compiled_graphs()
    assert graph.handled_by == "rbcompile"
    assert _prunable_kinds(graph) == ["attention", "mlp"]


@pytest.mark.parametrize("use_cache, prunable", [(False, ["attention", "mlp"]), (True, ["mlp"])])
def test_a_module_called_through_a_global_belongs_to_its_caller(monkeypatch, use_cache, prunable):
    """transformers 5.25 makes `apply_rotary_pos_emb` a module-level nn.Module (a hub-kernel
    hook); dynamo names it `G['...'].apply_rotary_pos_emb` in nn_module_stack. Its nodes stay in
    the attention that calls it: compiled, not fallen back, at parity."""
    from transformers.models.llama import modeling_llama

    class Func(torch.nn.Module):
        def __init__(self, function):
            super().__init__()
            self.function = function

        def forward(self, *args, **kwargs):
            return self.function(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        Func(modeling_llama.apply_rotary_pos_emb))
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options=STRICT_EAGER)
    with torch.no_grad():
        for batch, seq in ((2, 8), (3, 13)):  # static, then dynamic shapes
            ids, mask = _inputs(batch, seq)
            got = _first(compiled(ids, attention_mask=mask, use_cache=use_cache))
            expected = _first(model(ids, attention_mask=mask, use_cache=use_cache))
            assert (expected - got).abs().max() <= 1e-5
    graphs = backend.compiled_graphs()
    assert [graph.handled_by for graph in graphs] == ["rbcompile", "rbcompile"]
    for graph in graphs:
        assert _prunable_kinds(graph) == prunable


def test_decoder_with_kv_cache_keeps_attention_in_the_skeleton():
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options=STRICT_EAGER)
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        compiled(ids, attention_mask=mask, use_cache=True)
        compiled_no_cache = torch.compile(make_tiny_model("llama"), backend="rbcompile",
                                          options=STRICT_EAGER)
        compiled_no_cache(ids, attention_mask=mask, use_cache=False)
    with_cache, without = backend.compiled_graphs()
    assert _prunable_kinds(with_cache) == ["mlp"]          # attention branches write K/V: always run
    assert _prunable_kinds(without) == ["attention", "mlp"]


def test_gates_come_from_the_runtime_without_recompiling():
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options=LOSSY)
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        full = compiled(ids, attention_mask=mask, use_cache=False).logits
        with backend.decision(budget=0.5):
            light = compiled(ids, attention_mask=mask, use_cache=False).logits
        (graph,) = backend.compiled_graphs()
        assert graph.last_skipped > 0 and not all(graph.last_gates)
        gates = [True] * graph.num_gates
        gates[2] = False
        with backend.decision(gates=gates):
            compiled(ids, attention_mask=mask, use_cache=False)
        assert graph.last_gates == gates
        again = compiled(ids, attention_mask=mask, use_cache=False).logits
    assert len(backend.compiled_graphs()) == 1 and graph.calls == 4  # no recompilation
    assert (full - light).abs().max() > 1e-3
    assert torch.equal(full, again)


def test_budget_option_is_the_default_decision():
    model = make_tiny_model("gpt2")
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        compiled = torch.compile(model, backend="rbcompile", options={**LOSSY, "budget": 0.5})
        compiled(ids, attention_mask=mask)
        assert backend.compiled_graphs()[0].last_skipped > 0
        with backend.decision(budget=0.0):
            compiled(ids, attention_mask=mask)
        assert backend.compiled_graphs()[0].last_skipped == 0


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_gives_the_eager_tokens(use_cache):
    model = make_tiny_model("llama")
    ids, mask = _inputs(2, 7)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache)
    expected = model.generate(ids, **settings)
    model.forward = torch.compile(model.forward, backend="rbcompile", options=STRICT_EAGER)
    got = model.generate(ids, **settings)
    assert torch.equal(expected, got)
    graphs = backend.compiled_graphs()
    assert graphs and all(g.handled_by == "rbcompile" for g in graphs)


def test_static_cache_generate_is_adaptive_in_its_mlps():
    """transformers' StaticCache adds a length counter beside the K/V writes: the attention
    branch keeps it (skeleton), the MLP branches stay prunable, and a budget skips them."""
    model = make_tiny_model("llama")
    ids, mask = _inputs(2, 7)
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False,
                    cache_implementation="static", disable_compile=True)
    expected = model.generate(ids, **settings)
    model.forward = torch.compile(model.forward, backend="rbcompile", options=LOSSY)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **settings), expected)
        graphs = backend.compiled_graphs()
        assert graphs and all(g.handled_by == "rbcompile" for g in graphs)
        layers = model.config.num_hidden_layers
        for graph in graphs:
            kinds = [r["unit_kind"] for r in graph.regions if r["kind"] == "prunable"]
            assert kinds == ["mlp"] * layers and graph.num_gates == layers
        with backend.decision(budget=0.5):
            model.generate(ids, **settings)
        assert all(g.last_skipped > 0 for g in backend.compiled_graphs())


def test_static_cache_writes_stay_in_the_graph_and_cuda_graphs_read_the_cache_in_place():
    """With a static cache the decode graph writes each layer's K and V in place (`index_copy_`,
    as an artifact's decoder does) and copies only what else the model writes (transformers'
    length counters) back after the graph, inside its CUDA graph: a decode step under (fake,
    CPU) CUDA graphs reads the cache tensors where they are and returns its logits alone (they
    were returned in full and copied back outside the graph). Tokens: eager's, call after call."""
    from shared import FakeCapture

    model = make_tiny_model("llama")
    ids, mask = _inputs(2, 7)
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False,
                    cache_implementation="static", disable_compile=True)
    expected = model.generate(ids, **settings)
    capture, forward = FakeCapture(), model.forward
    model.forward = torch.compile(forward, backend="rbcompile",
                                  options={**STRICT_EAGER, "cuda_graphs": True, "capture": capture})
    with torch.no_grad():
        for _ in range(3):
            result = model.generate(ids, **settings, return_dict_in_generate=True)
            assert torch.equal(result.sequences, expected)
    layers = model.config.num_hidden_layers
    _, decode = backend.compiled_graphs()   # the prefill makes its K/V (new tensors)
    assert len(decode.writes.in_place) - len(decode.writes.copied) == 2 * layers
    assert decode.writes.outputs == 1   # the logits
    kv = {id(tensor) for layer in result.past_key_values.layers for tensor in (layer.keys, layer.values)}
    assert max(sum(id(value) in kv for value in inputs) for inputs in capture.captured) == 2 * layers
    # with rbcompile's kernels (CUDA's default) the writes fuse with the rotary, as in an artifact
    torch._dynamo.reset()
    backend.reset()
    model.forward = torch.compile(forward, backend="rbcompile",
                                  options={**STRICT_EAGER, "kernels": True})
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **settings), expected)
    _, decode = backend.compiled_graphs()
    (fused,) = [entry["stats"] for entry in decode.passes if entry["pass"] == "fuse_kernels"]
    assert fused.get("rotary_write_kv") == layers, fused


def test_inductor_regions_match_eager():
    model = make_tiny_model("llama")
    compiled = torch.compile(model, backend="rbcompile", options={"strict": True})
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        got = compiled(ids, attention_mask=mask, use_cache=False).logits
    assert (expected - got).abs().max().item() <= 1e-5


class _Wrapped(torch.nn.Module):
    """A tiny model followed by a graph break and more work."""

    def __init__(self):
        super().__init__()
        self.model = make_tiny_model("bert")

    def forward(self, ids, mask):
        hidden = self.model(ids, attention_mask=mask).last_hidden_state
        torch._dynamo.graph_break()
        return torch.tanh(hidden) * 2


def test_graph_break_gives_correct_results():
    wrapped = _Wrapped().eval()
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        expected = wrapped(ids, mask)
        got = torch.compile(wrapped, backend="rbcompile", options=STRICT_EAGER)(ids, mask)
    assert (expected - got).abs().max().item() <= 1e-5
    handled = [g.handled_by for g in backend.compiled_graphs()]
    assert "rbcompile" in handled and "inductor" in handled  # the fragment after the break


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, h, carry):  # two streams in, two out: no single residual stream
        return torch.relu(self.linear(h)) + carry, carry * 0.5 + h


class _TwoStreamNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x):
        h, carry = x, torch.tanh(x)
        for layer in self.layers:
            h, carry = layer(h, carry)
        return h + carry


def test_unsupported_graph_falls_back_to_inductor_or_raises_in_strict():
    net, x = _TwoStreamNet().eval(), torch.randn(2, 16)
    with torch.no_grad():
        expected = net(x)
        got = torch.compile(net, backend="rbcompile", options={"regions": "eager"})(x)
    assert torch.allclose(expected, got, atol=1e-6)
    (graph,) = backend.compiled_graphs()
    assert graph.handled_by == "inductor" and "residual stream" in graph.reason
    torch._dynamo.reset()
    with pytest.raises(Exception, match="residual stream"), torch.no_grad():
        torch.compile(net, backend="rbcompile", options={"strict": True})(x)


def test_unknown_option_raises_value_error():
    model = make_tiny_model("gpt2")
    ids, mask = _inputs(1, 4)
    with pytest.raises(Exception) as caught, torch.no_grad():
        torch.compile(model, backend="rbcompile", options={"budgett": 0.2})(ids, attention_mask=mask)
    inner = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(inner, ValueError) and "budgett" in str(inner)


def test_decision_rejects_bad_budget():
    with pytest.raises(ValueError, match="budget"):
        with backend.decision(budget=float("nan")):
            pass


def test_entry_point_needs_no_import():
    code = ("import sys, torch\n"
            "assert 'rbcompile' in torch._dynamo.list_backends()\n"
            "net = torch.nn.Linear(4, 4)\n"
            "out = torch.compile(net, backend='rbcompile')(torch.randn(2, 4))\n"
            "assert 'rbcompile.frontend.backend' in sys.modules\n"
            "print('ok', tuple(out.shape))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok (2, 4)" in done.stdout


def test_minilm_parity_and_budget_through_torch_compile(minilm):
    from shared import SENTENCES

    _, eager, tokenizer = minilm
    compiled = torch.compile(eager, backend="rbcompile", options=LOSSY)
    with torch.no_grad():
        for texts in (SENTENCES, SENTENCES[:2]):
            batch = tokenizer(texts, return_tensors="pt", padding=True)
            expected = eager(**batch).last_hidden_state
            got = compiled(**batch).last_hidden_state
            assert (expected - got).abs().max().item() <= 1e-5
        with backend.decision(budget=0.34):
            light = compiled(**batch).last_hidden_state
    assert (expected - light).abs().max().item() > 1e-3
    assert {g.handled_by for g in backend.compiled_graphs()} == {"rbcompile"}
