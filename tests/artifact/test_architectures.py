"""The architecture registry: dimensions read from configs, width parameters that exist in real
models of each type, the error for an unknown type, and the records without a conftest model
(mistral, qwen2) compiled with full-path parity."""
import re

import pytest
import torch

import rbcompile
from rbcompile.artifact.architectures import REGISTRY, lookup
from rbcompile.errors import UserError

from conftest import TINY_VOCAB, make_tiny_model

# decoders of issue 19: transformers config class and the settings that exercise what each adds
DECODERS = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # per-head q/k norms; head_dim != hidden / heads
    "phi3": ("Phi3Config", {}),                  # fused qkv_proj and gate_up_proj
    "olmo2": ("Olmo2Config", {}),                # norms after each branch; q/k norms over all heads
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    # sliding (window 4) and global layers mixed, soft-capping, (1 + w) norms, GeGLU, tied
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 4}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 4,
                                         "layer_types": ["sliding_attention", "full_attention"],
                                         "final_logit_softcapping": 30.0}),
}


def _extra_config(model_type: str, layers: int = 2):
    import transformers
    from transformers import MistralConfig, Qwen2Config

    name, extra = DECODERS.get(model_type, (None, {}))
    config = getattr(transformers, name) if name else {"mistral": MistralConfig,
                                                       "qwen2": Qwen2Config}[model_type]
    if name:
        extra = {"bos_token_id": 1, "eos_token_id": 2, **extra}
    if "layer_types" in extra:  # the pattern repeated over the layers
        extra["layer_types"] = (extra["layer_types"] * layers)[:layers]
    return config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0, **extra)


# RoBERTa-shaped encoders (registry aliases of the roberta record): their config classes
ROBERTA_ALIASES = {"xlm-roberta": "XLMRobertaConfig", "camembert": "CamembertConfig"}


def _roberta_alias(model_type: str, head: str | None = None):
    """The tiny RoBERTa of tests/artifact/test_task_heads.py as an XLM-RoBERTa / CamemBERT model."""
    import transformers

    from shared import make_encoder
    roberta = make_encoder("roberta", head).config.to_dict()
    roberta.pop("model_type")
    config = getattr(transformers, ROBERTA_ALIASES[model_type]).from_dict(roberta)
    auto = getattr(transformers, f"AutoModelFor{head}" if head else "AutoModel")
    torch.manual_seed(0)
    return auto.from_config(config).eval()


def tiny_model(model_type: str, layers: int = 2):
    """A tiny random model of each registry model type (also used by
    benchmarks/bench_architectures.py). `layers`: the depth of the decoders made here (not
    conftest's llama and gpt2 nor the encoders, 4 layers each)."""
    from transformers import AutoModelForCausalLM

    if model_type in ("llama", "gpt2", "bert"):
        return make_tiny_model(model_type)
    if model_type in ("roberta", "distilbert"):  # encoders: tests/artifact/test_task_heads.py
        from shared import make_encoder
        return make_encoder(model_type)
    if model_type in ROBERTA_ALIASES:
        return _roberta_alias(model_type)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_extra_config(model_type, layers)).eval()


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_dimensions_and_width_parameters_match_a_real_model(model_type):
    model = tiny_model(model_type)
    architecture = lookup(model.config)
    assert architecture.model_type == model_type
    dims = architecture.dimensions(model.config)
    attention = next(m for m in model.modules() if hasattr(m, "head_dim")
                     or type(m).__name__ in ("BertSelfAttention", "GPT2Attention",
                                             "RobertaSelfAttention", "XLMRobertaSelfAttention",
                                             "CamembertSelfAttention",
                                             "DistilBertSelfAttention", "MultiHeadSelfAttention"))
    assert dims.layers == 2 if model_type in ("mistral", "qwen2", *DECODERS) else dims.layers == 4
    assert (dims.hidden, dims.heads, dims.vocab, dims.max_positions) == (32, 4, TINY_VOCAB, 64)
    assert dims.head_dim == getattr(attention, "head_dim", 32 // 4)
    assert dims.kv_heads == (4 if lookup(model.config).family == "encoder" or model_type == "gpt2"
                             else 2)
    parameters = dict(model.named_parameters())

    def in_blocks(suffix):  # `suffix` right under a numbered block (model.layers.3.<suffix>)
        return [p for n, p in parameters.items() if re.fullmatch(rf".*\.\d+\.{re.escape(suffix)}", n)]

    for part in ("heads", "channels"):
        for parameter in architecture.width_parameters(part):
            found = in_blocks(parameter.suffix)
            if parameter.suffix.endswith("weight"):
                assert len(found) == dims.layers, (model_type, parameter.suffix)
            sizes = {"channels": dims.channels, "q": dims.heads * dims.head_dim,
                     "kv": dims.kv_heads * dims.head_dim}
            if found:  # fused blocks side by side (GPT-2's and Phi-3's)
                assert found[0].shape[parameter.axis] == sum(sizes[s] for s in parameter.layout)
    names = list(parameters)
    for part in architecture.kv_projections:
        assert any(part in name for name in names), (model_type, part)


def test_unknown_model_type_says_where_to_add_a_record():
    with pytest.raises(UserError) as error:
        lookup({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    message = str(error.value)
    assert "model_type='t5' (T5ForConditionalGeneration)" in message
    assert f"supported: {', '.join(sorted(REGISTRY))}" in message
    assert "rbcompile/artifact/architectures.py" in message


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_records_without_a_conftest_model_compile_with_full_path_parity(model_type):
    model = tiny_model(model_type)
    compiled = rbcompile.compile(model)
    assert compiled.manifest["architecture"]["model_type"] == model_type
    ids = torch.randint(0, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    logits = compiled(ids, mask)["logits"]
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    assert compiled.num_gates > 0


@pytest.mark.parametrize("model_type", sorted(ROBERTA_ALIASES))
def test_roberta_aliases_parity_and_classifier_head(model_type):
    """XLM-RoBERTa and CamemBERT compile as the roberta record (positions from pad_token_id +
    1, padded rows too), headless and with a sequence classifier kept in the artifact."""
    from shared import assert_parity

    for head in (None, "SequenceClassification"):
        model = _roberta_alias(model_type, head)
        assert type(model).__name__.startswith(("XLMRoberta", "Camembert"))
        compiled = rbcompile.compile(model)
        assert compiled.manifest["architecture"]["model_type"] == model_type
        assert_parity(compiled, model, "roberta")
        assert compiled.task_head == ("sequence-classification" if head else None)
        assert [r["unit_kind"] for r in compiled.regions if r["kind"] == "prunable"] == ["layer"] * 4


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_decoders_parity_regions_skips_and_cached_generate(model_type):
    """Full path equals eager at two padded shapes; each layer's attention and MLP branch is
    prunable and skipping it equals eager with that branch adding zero (post-norms, multipliers
    and soft-capping included); the KV-cached decoder generates HF's greedy tokens, one token a
    step and with n-gram drafts (several a step, each row's rejected slots masked: a sliding
    window must count positions, not slots). Both graphs are compiled as on CUDA (stacked
    projections: q / k norms per head in Qwen3, over the whole projection in OLMo 2; Phi-3's
    come stacked)."""
    from rbcompile.artifact.module import stacks

    from conftest import eager_outputs, max_diff, random_batch
    from shared import DECODER_PROMPTS, hf_new_tokens, reference_without

    model = tiny_model(model_type)
    compiled = rbcompile.compile(model, stack_projections=True)
    for module in (compiled.module, compiled.decoder.module):   # the main graph stacks too
        assert len(stacks(module)) == (0 if model_type == "phi3" else 4)
    for batch, seq in ((2, 12), (3, 21)):
        ids, mask = random_batch(batch, seq, seed=seq)  # the last row left-padded
        assert max_diff(compiled(ids, mask), eager_outputs(model, ids, mask)) <= 1e-5
    prunable = [r for r in compiled.regions if r["kind"] == "prunable"]
    assert [(r["layer"], r["unit_kind"]) for r in prunable] == [
        (layer, kind) for layer in range(2) for kind in ("attention", "mlp")]
    ids, mask = random_batch(2, 13)
    for region in prunable:
        gates = [True] * compiled.num_gates
        gates[region["gate"]] = False
        expected = eager_outputs(reference_without(model, region), ids, mask)
        assert max_diff(compiled(ids, mask, gates=gates), expected) <= 1e-5, region["name"]
    decoder_units = [r["unit_kind"] for r in compiled.decoder.ir["regions"] if r["kind"] == "prunable"]
    assert decoder_units == ["mlp", "mlp"]
    mask = (DECODER_PROMPTS != 0).long()
    expected = hf_new_tokens(model, DECODER_PROMPTS, mask, 10)
    for speculate in ("off", "ngram"):
        assert compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=10,
                                 speculate=speculate).tokens == expected, speculate


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "olmo2", "gemma2"])
def test_width_permutation_is_exact_and_narrowing_keeps_to_prefixes(model_type):
    """Heads and channels in a random order: the function is unchanged (Phi-3's fused blocks
    each permuted in their own index space, OLMo 2's q/k norm weights with their heads); a
    width level narrows only what a prefix expresses (Qwen3 both; OLMo 2 its MLPs, its q/k
    norms spanning all heads; Phi-3 nothing, its projections fused)."""
    from rbcompile.compiler.driver import generate_module
    from rbcompile.compiler.trace import example_inputs, trace
    from rbcompile.compiler.width import narrowed_model
    from rbcompile.passes import CALIBRATED_PIPELINE, PassContext, run_pipeline

    from conftest import eager_outputs, random_batch

    model = tiny_model(model_type)
    with torch.no_grad():  # norms initialised to ones would hide a norm weight left unpermuted
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1)))
    architecture = lookup(model.config)
    dims = architecture.dimensions(model.config)
    traced = trace(model, architecture)
    reference = example_inputs(architecture, dims.vocab, batch=1, seq=8)
    ctx = PassContext(family=architecture.family, reference_inputs=reference,
                      input_names=traced.input_names, architecture=architecture, dims=dims)
    gm = traced.graph_module
    run_pipeline(gm, ctx)
    # heads are measured at the output projection's input (not at eager attention's weights @ V)
    assert {unit.width.get("attention_out", "o_proj").rsplit(".", 1)[-1]
            for unit in ctx.units} == {"o_proj"}
    ids, mask = random_batch(2, 12)
    before = eager_outputs(model, ids, mask)["logits"]
    ctx.width_importance = {  # ascending scores: every head, KV group and channel moves
        unit.name: {"heads": [float(h) for h in range(dims.heads)]} if unit.kind == "attention"
        else {"channels": [float(c) for c in range(dims.channels)]} for unit in ctx.units}
    original = {name: tensor.clone() for name, tensor in gm.named_parameters()}
    run_pipeline(gm, ctx, CALIBRATED_PIPELINE)
    _, _, module = generate_module(gm, ctx.regions, traced.input_names, traced.output_names,
                                   model_type)
    with torch.no_grad():
        after = module(ids, mask, [True] * module.NUM_GATES, None)[0]
    moved = [name for name, tensor in gm.named_parameters()
             if not torch.equal(tensor, original[name])]
    assert any("qkv_proj" in n or "q_proj" in n for n in moved)
    if model_type == "olmo2":
        assert any("q_norm" in n for n in moved) and any("k_norm" in n for n in moved)
    assert (before - after).abs().max().item() <= 1e-5
    _, views = narrowed_model(model, {}, architecture, ctx.units, ctx.blocks, 0.5)
    narrowed = {name.split(".")[-2] for name in views}
    assert narrowed == {"qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"},
                        "olmo2": {"gate_proj", "up_proj", "down_proj"}, "phi3": set(),
                        "gemma2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj"}}[model_type]


@pytest.mark.parametrize("model_type", sorted(DECODERS))
def test_fusion_recognises_the_norms_and_activations_or_says_what_it_left(model_type):
    """Llama-form RMSNorms (q/k norms too), SwiGLU in either operand order (Phi-3's
    `up * silu(gate)`) and the rotary embedding of q and k are fused; Gemma's `(1 + w)` norms
    are left and named in the pass log; the fused full path still equals eager."""
    from rbcompile.compiler.driver import generate_module
    from rbcompile.compiler.trace import example_inputs, trace
    from rbcompile.passes import PIPELINE, PassContext, run_pipeline

    from conftest import eager_outputs, random_batch

    model = tiny_model(model_type)
    architecture = lookup(model.config)
    dims = architecture.dimensions(model.config)
    traced = trace(model, architecture)
    ctx = PassContext(family=architecture.family, input_names=traced.input_names,
                      reference_inputs=example_inputs(architecture, dims.vocab, batch=1, seq=8),
                      architecture=architecture, dims=dims, kernels=True)
    run_pipeline(traced.graph_module, ctx, PIPELINE)
    (entry,) = [p for p in ctx.history if p["pass"] == "fuse_kernels"]
    stats = entry["stats"]
    assert stats.get("rotary") == 4, entry["summary"]  # q and k of 2 layers
    assert stats.get("rotary_pair") == 2, entry["summary"]  # each layer's in one op
    if model_type.startswith("gemma"):
        assert stats.get("gelu") == 2 and "rms_norm" not in stats
        norms = 4 * 2 + 1 + (4 if model_type == "gemma3_text" else 0)  # + Gemma 3's q/k norms
        assert f"left unfused: {norms} norms (rsqrt)" in entry["summary"]
    else:
        assert stats.get("swiglu") == 2 and "unfused" not in stats, entry["summary"]
        assert stats.get("rms_norm", 0) + stats.get("add+rms_norm", 0) >= 5
    _, _, module = generate_module(traced.graph_module, ctx.regions, traced.input_names,
                                   traced.output_names, model_type)
    ids, mask = random_batch(2, 12)
    with torch.no_grad():
        logits = module(ids, mask, [True] * module.NUM_GATES, None)[0]
    assert (logits - eager_outputs(model, ids, mask)["logits"]).abs().max().item() <= 1e-5


def test_mistral_sliding_window_in_the_cached_decoder():
    """Mistral slides every layer (no per-layer types): with a window shorter than the text,
    the cached decoder still generates HF's greedy tokens, with n-gram drafts too."""
    from transformers import AutoModelForCausalLM

    from shared import DECODER_PROMPTS, hf_new_tokens

    config = _extra_config("mistral")
    config.sliding_window, config.bos_token_id, config.eos_token_id = 4, 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    compiled = rbcompile.compile(model)
    mask = (DECODER_PROMPTS != 0).long()
    expected = hf_new_tokens(model, DECODER_PROMPTS, mask, 10)
    for speculate in ("off", "ngram"):
        assert compiled.generate(DECODER_PROMPTS, mask, max_new_tokens=10,
                                 speculate=speculate).tokens == expected, speculate
