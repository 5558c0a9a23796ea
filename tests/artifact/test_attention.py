"""rbcompile/artifact/attention.py: attention over grouped K/V heads, its form chosen per call, equals
SDPA over repeated K/V heads (transformers' eager computation) in every form."""
import pytest
import torch
import torch.nn.functional as F

import rbcompile.artifact.attention as attention
from rbcompile.artifact.attention import FORMS, folds, form, grouped_attention, repeat_kv

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
# (batch, query heads, K/V heads, queries, keys, mask rows): decode steps, a verify step of
# speculation, prefills; odd sizes
SHAPES = [(2, 9, 3, 1, 37, 1), (1, 32, 8, 1, 130, 1), (2, 9, 3, 5, 37, 5), (3, 4, 1, 7, 19, 1),
          (1, 6, 2, 33, 33, 33), (2, 9, 3, 64, 64, 64)]


def _inputs(shape, dtype, seed=0):
    batch, heads, kv_heads, queries, keys, rows = shape
    generator = torch.Generator().manual_seed(seed)

    def tensor(*sizes):
        return torch.randn(*sizes, generator=generator).to(dtype)

    # queries as a projection makes them: [B, Q, H, D] seen as [B, H, Q, D]
    query = tensor(batch, queries, heads, 16).transpose(1, 2)
    key, value = tensor(batch, kv_heads, keys, 16), tensor(batch, kv_heads, keys, 16)
    mask = torch.zeros(batch, 1, rows, keys, dtype=dtype)
    mask[0, ..., :3] = float("-inf")   # a left-padded row
    return query, key, value, mask


def _reference(query, key, value, mask, is_causal=False):
    group = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, repeat_kv(key, group), repeat_kv(value, group),
                                          mask, is_causal=is_causal)


@pytest.fixture
def forms(monkeypatch):
    """`form(query_heads)`: the forms the calls since the last `form` ran ("folded": fewer
    query heads than the call's; "copies": K/V heads repeated; "enable_gqa")."""
    calls = []
    sdpa = attention._SDPA

    def recording(query, key, value, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(query, key, value, *args, **kwargs)

    def form(query_heads):
        taken = ["enable_gqa" if gqa else "folded" if heads < query_heads else
                 "copies" if heads == key_heads else "?" for heads, key_heads, gqa in calls]
        calls.clear()
        return taken

    monkeypatch.setattr(attention, "_SDPA", recording)
    return form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_form_equals_attention_over_repeated_heads(shape, dtype, forms):
    query, key, value, mask = _inputs(shape, dtype)
    want = _reference(query, key, value, mask)
    got = grouped_attention(query, key, value, mask)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=0)
    # on CPU: a single query folded in 16-bit, else enable_gqa
    folded = dtype is torch.bfloat16 and query.shape[2] == 1
    assert forms(query.shape[1]) == ["folded" if folded else "enable_gqa"]
    for name, compute in FORMS.items():   # each form, whichever the device would take
        torch.testing.assert_close(compute(query, key, value, mask, 0.0, False, None), want,
                                   atol=TOLERANCE[dtype], rtol=0)
    assert forms(query.shape[1]) == list(FORMS)


MASKS = {  # how the mask of a call with 2 rows of 5 queries over 11 keys may come
    "additive": lambda: torch.zeros(2, 1, 5, 11).masked_fill(torch.arange(11) < 3, float("-inf")),
    "bool": lambda: torch.arange(11) >= torch.tensor([[3], [0]]).view(2, 1, 1, 1),
    "one row for the batch": lambda: torch.zeros(1, 1, 5, 11).masked_fill(torch.arange(11) > 8,
                                                                          float("-inf")),
    "one row for the queries": lambda: torch.zeros(2, 1, 1, 11).masked_fill(torch.arange(11) < 2,
                                                                            float("-inf")),
    "one column for the keys": lambda: torch.zeros(2, 1, 5, 1),
    "a fully masked row": lambda: torch.zeros(2, 1, 5, 11).index_fill(2, torch.tensor([1]),
                                                                      float("-inf")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("value_dim, scale", [(16, None), (24, 0.3)], ids=["plain", "wide-v-scaled"])
def test_folded_queries_equal_sdpa_for_every_mask_they_take(mask_kind, value_dim, scale, dtype):
    """Folding is exact for each mask shape a call may bring (bool or additive, broadcast over
    the batch, the queries or the keys, a row with no key), a value wider than the key and an
    explicit scale: the same values as SDPA's own grouped heads, NaN where it gives NaN."""
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 5, 6, 16, generator=generator).to(dtype).transpose(1, 2)
    key = torch.randn(2, 2, 11, 16, generator=generator).to(dtype)
    value = torch.randn(2, 2, 11, value_dim, generator=generator).to(dtype)
    mask = MASKS[mask_kind]()
    mask = mask if mask.dtype is torch.bool else mask.to(dtype)
    want = F.scaled_dot_product_attention(query, key, value, mask, scale=scale, enable_gqa=True)
    got = FORMS["folded"](query, key, value, mask, 0.0, False, scale)
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=0, equal_nan=True)
    assert got.shape == want.shape == (2, 6, 5, value_dim)


def test_folding_is_chosen_by_what_it_moves():
    """A decode step folds (one query: a view; one mask row: broadcast); a verify step of a few
    queries folds; a prefill as long as its keys does not (its queries, output and G mask
    copies would move more than K/V copies); nor does a call without mask, a causal one or
    one whose mask has a row per head."""
    def decision(shape, **changes):
        query, key, value, mask = _inputs(shape, torch.float32)
        mask = changes.get("mask", mask)
        return folds(query, key, value, mask, changes.get("is_causal", False))

    assert decision((1, 9, 3, 1, 512, 1)) and decision((8, 32, 8, 1, 40, 1))
    assert decision((1, 9, 3, 5, 512, 5))
    assert not decision((4, 32, 8, 1024, 1024, 1024)) and not decision((1, 9, 3, 128, 128, 128))
    assert not decision((1, 9, 3, 1, 512, 1), mask=None)
    assert not decision((1, 9, 3, 1, 512, 1), is_causal=True)
    assert not decision((1, 9, 3, 1, 512, 1), mask=torch.zeros(1, 9, 1, 512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_call_without_mask_reads_grouped_heads(dtype, forms):
    """A call without padding (passes/unpadded_attention.py: no mask, causal) is never folded
    (folding breaks causality's diagonal): on CPU it takes enable_gqa, and equals the copies."""
    query, key, value, _ = _inputs((2, 9, 3, 12, 12, 12), dtype)
    got = grouped_attention(query, key, value, None, 0.0, True)
    torch.testing.assert_close(got, _reference(query, key, value, None, is_causal=True),
                               atol=TOLERANCE[dtype], rtol=0)
    assert forms(query.shape[1]) == ["enable_gqa"]


def test_each_device_takes_its_form():
    """CUDA folds where folding pays and copies otherwise (its kernel that takes a mask takes
    no grouped heads); CPU folds only in 16-bit floats and otherwise takes enable_gqa; another
    device takes enable_gqa. Fake tensors stand for the devices."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    decode, prefill = (1, 9, 3, 1, 64, 1), (1, 9, 3, 64, 64, 64)
    taken = {}
    with FakeTensorMode():
        for device in ("cuda", "cpu", "meta"):
            for dtype in (torch.float32, torch.bfloat16):
                for name, (batch, heads, kv_heads, queries, keys, rows) in (("decode", decode),
                                                                          ("prefill", prefill)):
                    def empty(*sizes):
                        return torch.empty(*sizes, device=device, dtype=dtype)
                    query = empty(batch, queries, heads, 16).transpose(1, 2)
                    key = value = empty(batch, kv_heads, keys, 16)
                    mask = empty(batch, 1, rows, keys)
                    taken[device, dtype, name] = form(query, key, value, mask, False)
                    taken[device, dtype, "no mask"] = form(query, key, value, None, True)
    for dtype in (torch.float32, torch.bfloat16):
        assert (taken["cuda", dtype, "decode"], taken["cuda", dtype, "prefill"],
                taken["cuda", dtype, "no mask"]) == ("folded", "copies", "copies")
        assert taken["meta", dtype, "decode"] == taken["meta", dtype, "no mask"] == "enable_gqa"
    assert taken["cpu", torch.bfloat16, "decode"] == "folded"
    assert {taken["cpu", torch.float32, "decode"], taken["cpu", torch.bfloat16, "prefill"],
            taken["cpu", torch.bfloat16, "no mask"]} == {"enable_gqa"}
    with FakeTensorMode():   # a verify step (5 queries) folds on CUDA, not on CPU
        for device in ("cuda", "cpu"):
            query = torch.empty(1, 9, 5, 16, device=device, dtype=torch.bfloat16)
            key = torch.empty(1, 3, 512, 16, device=device, dtype=torch.bfloat16)
            mask = torch.empty(1, 1, 5, 512, device=device, dtype=torch.bfloat16)
            taken[device, "verify"] = form(query, key, key, mask, False)
    assert (taken["cuda", "verify"], taken["cpu", "verify"]) == ("folded", "enable_gqa")


def test_as_many_query_heads_as_kv_heads_is_plain_attention():
    """A width variant may keep one query head per K/V head: plain SDPA."""
    query, key, value, mask = _inputs((2, 3, 3, 1, 9, 1), torch.float32)
    assert torch.equal(grouped_attention(query, key, value, mask),
                       F.scaled_dot_product_attention(query, key, value, mask))


def test_generated_code_routes_grouped_attention_and_older_artifacts_keep_theirs():
    """A GQA model's IR asks for `grouped_attention` and its generated code calls it for every
    attention (the ONNX export's code, its `enable_gqa` version); an IR without the key (an
    artifact from before) regenerates the code it was saved with: SDPA with enable_gqa. Both
    compute the eager model's outputs."""
    import rbcompile
    from rbcompile.artifact.codegen import generate_source
    from rbcompile.artifact.module import attach_weights, instantiate

    from conftest import make_tiny_model, random_batch

    eager = make_tiny_model("llama")
    compiled = rbcompile.compile(make_tiny_model("llama"))
    layers = eager.config.num_hidden_layers
    ir = compiled.ir
    assert ir["grouped_attention"] is True
    source = generate_source(ir)
    assert "from rbcompile.artifact.attention import grouped_attention" in source
    assert source.count("grouped_attention(") == layers and "enable_gqa" not in source
    assert "from rbcompile.frontend.onnx_export import grouped_attention" in generate_source(ir, "cond")
    older = generate_source({key: value for key, value in ir.items() if key != "grouped_attention"})
    assert "grouped_attention" not in older and older.count("enable_gqa=True") == layers
    ids, mask = random_batch(2, 9, seed=1)
    want = eager(input_ids=ids, attention_mask=mask).logits
    for code in (source, older):
        module = instantiate(code, "test")
        attach_weights([module], {key: getattr(compiled.module, name)
                                  for name, key in compiled.module.PARAMETERS.items()})
        got = module(ids, mask, [True] * module.NUM_GATES, None)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_decoder_folds_its_decode_steps_and_generates_eagers_tokens(dtype, monkeypatch):
    """In 16-bit floats on CPU the KV-cached decoder's steps (one query, the cache's mask)
    fold. Greedy tokens equal transformers' in the same dtype."""
    import rbcompile

    from conftest import make_tiny_model
    from shared import DECODER_PROMPTS, hf_new_tokens

    eager = make_tiny_model("llama").to(dtype)
    compiled = rbcompile.compile(make_tiny_model("llama"), dtype=dtype)
    taken, choose = [], attention.form

    def recorded(query, *args):
        taken.append((query.shape[2], choose(query, *args)))
        return taken[-1][1]

    monkeypatch.setattr(attention, "form", recorded)
    mask = (DECODER_PROMPTS != 0).long()
    result = compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=8)
    assert result.tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 8)
    steps = [chosen for queries, chosen in taken if queries == 1]
    assert set(steps) == {"folded"} and len(steps) == 7 * eager.config.num_hidden_layers
    assert taken[0][0] == DECODER_PROMPTS.shape[1]   # the prefill, whichever form
