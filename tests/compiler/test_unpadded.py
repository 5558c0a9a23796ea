"""Attention without its mask when no row is padded (passes/unpadded_attention.py): which masks
the pass recognises and which it leaves, what a call without padding runs (attention kernels
without a mask, causal for decoders) and that it equals eager transformers, through the region
interpreter, one compiled function per plan and CUDA graphs (a fake capture)."""
import pytest
import torch
from torch.fx.operator_schemas import normalize_function
from torch.utils._python_dispatch import TorchDispatchMode

import rbcompile
from rbcompile.artifact.ir import check_ir
from rbcompile.errors import UserError

from conftest import TINY_VOCAB, make_tiny_model
from shared import FakeCapture

_SDPA = "aten.scaled_dot_product_attention.default"


class AttentionCalls(TorchDispatchMode):
    """(is_causal, reads a mask) of every attention kernel run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            _, named = normalize_function(func, args, kwargs or {},
                                          normalize_to_only_use_kwargs=True)
            mask = named.get("attn_mask", named.get("attn_bias"))
            self.calls.append((bool(named.get("is_causal", False)), mask is not None))
        return func(*args, **(kwargs or {}))


def _attention_calls(run):
    with AttentionCalls() as calls:
        result = run()
    return result, calls.calls


def _inputs(batch=2, seq=10, seed=0):
    ids = torch.randint(3, TINY_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    padded = torch.ones_like(ids)
    padded[0, :3] = 0
    return ids, padded


@pytest.fixture(scope="module", params=["llama", "gpt2", "bert"])
def compiled(request):
    model = make_tiny_model(request.param)
    return model, rbcompile.compile(model), request.param != "bert"


def test_the_mask_input_and_causality_are_recognised_and_recorded(compiled):
    """One shared mask, dropped without padding; a decoder's attentions are causal exactly
    when it is absent (`operator.is_(mask, None)`), an encoder's just read no mask."""
    _, compiled, causal = compiled
    spec = compiled.ir["unpadded"]
    assert spec == {"input": "attention_mask", "like": [["input_ids", 0], ["input_ids", 1]],
                    "masks": spec["masks"], "causal": causal, "start": None}
    assert len(spec["masks"]) == 1
    nodes = {node[0]: node for node in compiled.ir["nodes"]}
    attentions = [node for node in compiled.ir["nodes"] if node[1] == _SDPA]
    assert len(attentions) == compiled.manifest["architecture"]["layers"]
    for _, _, args, kwargs, _ in attentions:
        assert args[3] == {"node": spec["masks"][0]}
        if causal:
            absent = nodes[kwargs["is_causal"]["node"]]
            assert absent[1:3] == ["operator.is_", [{"node": spec["masks"][0]}, None]]
        else:
            assert "is_causal" not in kwargs
    assert compiled.module.UNPADDED.masks == tuple(spec["masks"])
    if compiled.decoder is not None:  # queries from cache_position[0] on, keys over every slot
        spec = compiled.decoder.ir["unpadded"]
        assert spec["like"] == [["input_ids", 0], ["key_cache_0", 2]] and spec["causal"]
        assert spec["start"] == "cache_position" and compiled.decoder.unpadded_prefill


def test_masks_with_more_than_causality_and_padding_are_left_alone():
    """Mistral's sliding window is a third term: its attentions keep their mask."""
    from test_architectures import tiny_model

    model = tiny_model("mistral")
    compiled = rbcompile.compile(model)
    assert "unpadded" not in compiled.ir and not hasattr(compiled.module, "UNPADDED")
    ids, _ = _inputs()
    got, calls = _attention_calls(lambda: compiled(ids)["logits"])
    assert calls and all(masked and not causal for causal, masked in calls)
    assert (got - model(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_a_sliding_layers_mask_stays_where_a_full_layers_goes():
    """Gemma 3 alternates sliding-window and full layers: without padding only the full
    layers' attention drops its mask."""
    from test_architectures import tiny_model

    model = tiny_model("gemma3_text")
    compiled = rbcompile.compile(model)
    assert len(compiled.module.UNPADDED.masks) == 1 and compiled.module.UNPADDED.causal
    ids, _ = _inputs(seq=12)
    got, calls = _attention_calls(lambda: compiled(ids)["logits"])
    assert calls == [(False, True), (True, False)]  # layer_types: sliding, full
    assert (got - model(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_a_call_without_padding_runs_attention_unmasked_and_equals_eager(compiled):
    model, compiled, causal = compiled
    ids, padded = _inputs()
    name = compiled.output_names[0]
    for mask in (None, torch.ones_like(ids)):
        got, calls = _attention_calls(lambda: compiled(ids, mask)[name])
        assert calls == [(causal, False)] * len(calls) and calls
        assert (got - model(input_ids=ids)[0]).abs().max().item() <= 1e-5
        gates = [True] * compiled.num_gates
        masked = compiled.module(ids, torch.ones_like(ids), gates)[0]
        assert (got - masked).abs().max().item() <= 1e-5
    got, calls = _attention_calls(lambda: compiled(ids, padded)[name])
    assert calls == [(False, True)] * len(calls)
    expected = model(input_ids=ids, attention_mask=padded)[0]
    assert ((got - expected) * padded[..., None]).abs().max().item() <= 1e-5
    compiled.unpadded_attention = False  # every call reads its mask (as before the pass)
    try:
        got, calls = _attention_calls(lambda: compiled(ids)[name])
        assert calls == [(False, True)] * len(calls)
        assert (got - model(input_ids=ids)[0]).abs().max().item() <= 1e-5
    finally:
        compiled.unpadded_attention = True


def test_a_prefill_from_the_first_slot_attends_causally_without_its_mask(compiled):
    """The KV-cached decoder: a generation's prefill from the first slot of rows without
    padding passes no mask (layer 0's attention, in the region that makes the mask, still
    reads it); decode steps and padded prompts read their masks. HF's greedy tokens."""
    model, compiled, _ = compiled
    if compiled.decoder is None:
        pytest.skip("an encoder")
    ids, padded = _inputs(seq=12, seed=4)
    layers = compiled.manifest["architecture"]["layers"]
    for mask in (torch.ones_like(ids), padded):
        result, calls = _attention_calls(lambda: compiled.generate(ids, mask, max_new_tokens=3))
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert result.tokens == expected[:, ids.shape[1]:].tolist()
        prefill, steps = calls[:layers], calls[layers:]
        assert len(steps) == 2 * layers and set(steps) == {(False, True)}
        unmasked = prefill.count((True, False))
        assert unmasked + prefill.count((False, True)) == layers
        assert unmasked >= layers - 1 if mask is not padded else unmasked == 0


def test_plan_functions_fill_the_mask_input_and_drop_the_mask(compiled):
    """compile_plans writes a plan of its own for calls without padding (the mask input filled
    with ones, the mask None after the region that makes it); both equal the interpreter."""
    _, compiled, _ = compiled
    ids, padded = _inputs(seed=1)
    name = compiled.output_names[0]
    expected = {key: compiled(ids, mask)[name] for key, mask in (("no padding", None),
                                                                 ("padded", padded))}
    plans = compiled.compile_plans(max_plans=4).plan_graphs
    plans.compiler = lambda fn: fn
    try:
        for key, mask in (("no padding", None), ("padded", padded)):
            assert (compiled(ids, mask)[name] - expected[key]).abs().max().item() <= 1e-5
        assert plans.stats.compiles == 2
        gates = [True] * compiled.num_gates
        source, spec = plans.source(gates, unpadded=True), compiled.module.UNPADDED
        assert ("    attention_mask = input_ids.new_ones((input_ids.shape[0], input_ids.shape[1]))"
                "  # no padding") in source
        assert f"    {spec.masks[0]} = None" in source
        assert "new_ones" not in plans.source(gates) and " = None" not in plans.source(gates)
    finally:
        compiled.module.forward = plans.interpreter


def test_cuda_graphs_take_no_mask_unless_an_encoders_padding_needs_one(compiled):
    """Causal attention is blind to the keys after the last token: a decoder's graph takes no
    mask even when the runtime pads the sequence to its bucket (10 and 16 tokens: one graph).
    An encoder's needs the mask then, and takes none when the sequence fills its bucket."""
    model, compiled, causal = compiled
    compiled.use_cuda_graphs(capture=FakeCapture(), batch_buckets=(2,), seq_multiple=16)
    name = compiled.output_names[0]
    try:
        for seq in (10, 16):
            ids, _ = _inputs(seq=seq, seed=2)
            got = compiled(ids)[name]
            assert (got - model(input_ids=ids)[0]).abs().max().item() <= 1e-5
        mask_keys = [key[1][1] for key in compiled.cuda_graphs.keys()]
        takes_mask = [key is not None for key in mask_keys]
        assert takes_mask == ([False] if causal else [True, False])
    finally:
        compiled.use_cuda_graphs(False)


def test_a_corrupt_unpadded_record_is_refused(compiled):
    """A bad record, or an attention over a dropped mask without the causality it needs (or
    with causality an encoder's lacks): a decoder would attend to later tokens."""
    _, compiled, causal = compiled
    for change in ({"masks": ["input_ids"]}, {"input": "nowhere"}, {"like": "input_ids"},
                   {"like": [["attention_mask", 0]]}, {"like": [["input_ids", -1]]},
                   {"start": "nowhere"}, {"causal": "yes"}, {"masks": []}):
        ir = {**compiled.ir, "unpadded": {**compiled.ir["unpadded"], **change}}
        with pytest.raises(UserError, match="bad unpadded attention masks"):
            check_ir(ir)
    nodes = [list(node) for node in compiled.ir["nodes"]]
    attention = next(node for node in nodes if node[1] == _SDPA)
    attention[3] = ({k: v for k, v in attention[3].items() if k != "is_causal"} if causal
                    else {**attention[3], "is_causal": True})
    with pytest.raises(UserError, match=f"{attention[0]} reads a dropped attention mask"):
        check_ir({**compiled.ir, "nodes": nodes})


def test_the_record_survives_save_and_load(compiled, tmp_path):
    model, compiled, causal = compiled
    loaded = rbcompile.load(compiled.save(tmp_path / "artifact"))
    assert loaded.module.UNPADDED == compiled.module.UNPADDED
    ids, _ = _inputs(seed=3)
    got, calls = _attention_calls(lambda: loaded(ids)[loaded.output_names[0]])
    assert calls == [(causal, False)] * len(calls) and calls
    assert (got - model(input_ids=ids)[0]).abs().max().item() <= 1e-5


def test_a_mask_read_only_in_its_own_region_is_kept():
    """A one-layer decoder's KV-cached graph makes its mask in the region of its only attention:
    nothing to drop there (the main graph's attention, in a region of its own, drops it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    compiled = rbcompile.compile(model)
    assert compiled.module.UNPADDED.causal and "unpadded" not in compiled.decoder.ir
    assert not compiled.decoder.unpadded_prefill
    ids, _ = _inputs(batch=1, seq=10, seed=5)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                              do_sample=False)
    assert compiled.generate(ids, max_new_tokens=4).tokens == expected[:, 10:].tolist()
