"""What several test files share: a fake CUDA capture, decoder prompts and HF's greedy tokens,
tiny encoders with task heads, the eager reference of a skipped region, real sentences."""
import copy

import torch

from conftest import TINY_VOCAB, random_batch, save_tiny_tokenizer, tiny_config


class FakeCapture:
    """Captures by running once; a replay recomputes from the same static inputs into the same
    static outputs (what a CUDA graph does)."""

    def __init__(self):
        self.captured = []

    def __call__(self, run, inputs):
        outputs = run(*inputs)
        self.captured.append(inputs)

        def replay():
            fresh = run(*inputs)
            for static, value in zip(outputs if isinstance(outputs, (list, tuple)) else [outputs],
                                     fresh if isinstance(fresh, (list, tuple)) else [fresh]):
                static.copy_(value)
        return replay, outputs


DECODER_PROMPTS = torch.tensor([[0, 0, 21, 22, 23, 21, 22], [31, 32, 33, 34, 35, 31, 32]])


def hf_new_tokens(model, ids, mask, max_new_tokens):
    """HF greedy generate's new tokens per row, cut after the first EOS (HF pads after it)."""
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows


LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def int4_measured(checkpoint, loss_guard: float = 10.0):
    """The tiny Llama compiled with int4 measured on held-out text, its decode step recorded as
    faster than fp32 at 1 row only, under a guard of `loss_guard`."""
    import rbcompile
    from rbcompile.artifact.executors import StoredPrecision
    from rbcompile.artifact.guard import QualityGuard

    model = rbcompile.compile(checkpoint, precisions=("int4",))
    stored = StoredPrecision.from_json(model.manifest["precisions"][0])
    model.manifest["precisions"] = [StoredPrecision(
        "int4", stored.decoder_quality_loss, stored.heldout, ((1, 2.0), (2, 0.5))).to_json()]
    model.guard = QualityGuard(loss_guard)
    return model


def encoder_config(model_type: str):
    from transformers import DistilBertConfig, RobertaConfig

    if model_type == "bert":
        return tiny_config("bert")
    if model_type == "roberta":  # positions start at pad_token_id + 1: 64 usable
        return RobertaConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=4,
                             num_attention_heads=4, intermediate_size=48,
                             max_position_embeddings=66, pad_token_id=1)
    return DistilBertConfig(vocab_size=TINY_VOCAB, dim=32, n_layers=4, n_heads=4, hidden_dim=48,
                            max_position_embeddings=64)


def make_encoder(model_type: str, head: str | None = None):
    """A tiny random encoder, headless (AutoModel) or with a 3-label `head`."""
    import transformers

    config = encoder_config(model_type)
    if head is not None:
        config.num_labels = len(LABELS)
        config.id2label, config.label2id = LABELS, {v: k for k, v in LABELS.items()}
    auto = getattr(transformers, f"AutoModelFor{head}" if head else "AutoModel")
    torch.manual_seed(0)
    return auto.from_config(config).eval()


def save_checkpoint(model, folder):
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def padded_batch(model_type: str, batch: int, seq: int, seed: int = 0):
    ids, mask = random_batch(batch, seq, seed=seed)
    if model_type == "roberta":  # its positions count non-pad tokens: pad where masked
        ids = ids.masked_fill(mask == 0, 1)
    return ids, mask


def eager(model, ids, mask) -> dict:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    if getattr(out, "logits", None) is not None:
        return {"logits": out.logits, "last_hidden_state": out.hidden_states[-1]}
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def assert_parity(compiled, model, model_type, shapes=((2, 13), (3, 64), (1, 5))):
    for batch, seq in shapes:
        ids, mask = padded_batch(model_type, batch, seq)
        out, expected = compiled(ids, mask), eager(model, ids, mask)
        assert set(out) == set(expected)
        for name in expected:
            assert (out[name] - expected[name]).abs().max().item() <= 1e-5, (name, batch, seq)


def module_at(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _replace_output(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


def identity_layer_hook(module, args, kwargs, output):
    hidden = args[0] if args else kwargs["hidden_states"]
    return _replace_output(output, hidden)


def _zero_branch_hook(module, args, output):
    first = output[0] if isinstance(output, tuple) else output
    return _replace_output(output, torch.zeros_like(first))


def reference_without(eager, region):
    """Copy of the eager model where `region` contributes nothing to the residual stream."""
    reference = copy.deepcopy(eager)
    target = module_at(reference, region["module_path"])
    if region["unit_kind"] == "layer":
        target.register_forward_hook(identity_layer_hook, with_kwargs=True)
    else:  # a residual branch adds zero
        target.register_forward_hook(_zero_branch_hook)
    return reference


SENTENCES = [
    "A gripping, beautifully acted film that stays with you long after the credits.",
    "Dull.",
    "The plot meanders, but the performances are strong enough to carry it.",
    "An unfunny comedy whose jokes land with a thud, one after another, for two long hours.",
]


def run_linear_graph(build, packed, x: torch.Tensor) -> torch.Tensor:
    """One linear as the step graph builds it, run in onnxruntime on x [B, T, in]: `build(
    builder)` adds its nodes reading "x" (step_graph._Builder over `packed`) and names its
    output."""
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    from rbcompile.artifact.ort_threads import session_options
    from rbcompile.artifact.step_graph import MS_DOMAIN, StepShape, StepVariant, _Builder

    builder = _Builder(StepShape(1, x.shape[-1], 1, 1, 1, 1, 1e-5, 1), StepVariant(),
                       source=lambda name: packed)
    y = build(builder)
    width = packed.out_features
    graph = helper.make_graph(
        builder.nodes, "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, x.shape[-1]])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [None, None, width])],
        builder.constants + [onnx.numpy_helper.from_array(value, name)
                             for name, value in builder.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid(MS_DOMAIN, 1)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), session_options(),
                                           providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
