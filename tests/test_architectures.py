"""The architecture registry: dimensions read from configs, width parameters that exist in real
models of each type, the error for an unknown type, and the records without a conftest model
(mistral, qwen2) compiled with full-path parity."""
import re

import pytest
import torch

import rbcompile
from conftest import TINY_VOCAB, make_tiny_model
from rbcompile.architectures import REGISTRY, lookup
from rbcompile.errors import UserError


def _extra_config(model_type: str):
    from transformers import MistralConfig, Qwen2Config

    config = {"mistral": MistralConfig, "qwen2": Qwen2Config}[model_type]
    return config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, pad_token_id=0)


def _tiny(model_type: str):
    from transformers import AutoModelForCausalLM

    if model_type in ("llama", "gpt2", "bert"):
        return make_tiny_model(model_type)
    if model_type in ("roberta", "distilbert"):  # encoders: tests/test_task_heads.py
        from test_task_heads import make_encoder
        return make_encoder(model_type)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_extra_config(model_type)).eval()


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_dimensions_and_width_parameters_match_a_real_model(model_type):
    model = _tiny(model_type)
    architecture = lookup(model.config)
    assert architecture.model_type == model_type
    dims = architecture.dimensions(model.config)
    attention = next(m for m in model.modules() if hasattr(m, "head_dim")
                     or type(m).__name__ in ("BertSelfAttention", "GPT2Attention",
                                             "RobertaSelfAttention",
                                             "DistilBertSelfAttention", "MultiHeadSelfAttention"))
    assert dims.layers == 2 if model_type in ("mistral", "qwen2") else dims.layers == 4
    assert (dims.hidden, dims.heads, dims.vocab, dims.max_positions) == (32, 4, TINY_VOCAB, 64)
    assert dims.head_dim == getattr(attention, "head_dim", 32 // 4)
    assert dims.kv_heads == (4 if model_type in ("gpt2", "bert", "roberta", "distilbert") else 2)
    parameters = dict(model.named_parameters())

    def in_blocks(suffix):  # `suffix` right under a numbered block (model.layers.3.<suffix>)
        return [p for n, p in parameters.items() if re.fullmatch(rf".*\.\d+\.{re.escape(suffix)}", n)]

    for part in ("heads", "channels"):
        for parameter in architecture.width_parameters(part):
            found = in_blocks(parameter.suffix)
            if parameter.suffix.endswith("weight"):
                assert len(found) == dims.layers, (model_type, parameter.suffix)
            if found and parameter.space == "channels":
                assert found[0].shape[parameter.axis] == dims.channels
            if found and parameter.space == "q":
                assert found[0].shape[parameter.axis] == parameter.fused * dims.heads * dims.head_dim
    names = list(parameters)
    for part in architecture.kv_projections:
        assert any(part in name for name in names), (model_type, part)


def test_unknown_model_type_says_where_to_add_a_record():
    with pytest.raises(UserError) as error:
        lookup({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    message = str(error.value)
    assert "model_type='t5' (T5ForConditionalGeneration)" in message
    assert f"supported: {', '.join(sorted(REGISTRY))}" in message
    assert "rbcompile/architectures.py" in message


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_records_without_a_conftest_model_compile_with_full_path_parity(model_type):
    model = _tiny(model_type)
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
