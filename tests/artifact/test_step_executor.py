"""The onnxruntime step executor (artifact/step_executor.py, step_graph.py): its steps equal the
torch decoder's (prefill with pads, decode, several tokens per row, MLPs gated off, unpadded
prefill), generate gives HF's greedy tokens through it, the executor choice and the precision
rules (artifact/executors.py), and on real SmolLM2 weights the int4 level reproduces the
shipped 4-bit values."""
import pytest
import torch
from shared import DECODER_PROMPTS, hf_new_tokens

import rbcompile
from rbcompile.artifact.executors import StoredPrecision, check_precision
from rbcompile.artifact.guard import QualityGuard
from rbcompile.artifact.step_executor import ROW_STEPS_FROM
from rbcompile.errors import UserError
from rbcompile.runtime.engine.kv_cache import step_inputs

# The executor sums in another order than torch: its logits agree to fp32 rounding of the
# tiny model's (|logits| ~ 1), not bit for bit; the torch executor stays the reference.
ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(compiled_tiny):
    compiled, eager = compiled_tiny["llama"]
    model = rbcompile.load(compiled.save(__import__("tempfile").mkdtemp() + "/llama"))
    return model, eager


def _cache(decoder, rows, slots):
    shape = decoder.shape
    return [torch.zeros(rows, shape.kv_heads, slots, shape.head_dim)
            for _ in range(2 * shape.layers)]


def _both(model, gates=None):
    """A step function running the torch decoder and the executor on their own caches,
    asserting equal logits and equal cache contents at the written slots."""
    decoder = model.decoder
    executor = model.decoder.executor

    def run(caches, ids, mask, positions, slots, logit_positions):
        expected = decoder.__class__.__call__(_torch_only(decoder), ids, mask, positions,
                                              slots, logit_positions, caches[0], gates)
        got = executor(ids, mask, positions, slots, logit_positions, caches[1], gates)
        asked = mask[:, slots[logit_positions]].bool()   # a pad query's logits mean nothing
        assert (got - expected)[asked].abs().max() <= ATOL
        kept = mask[:, slots].bool()    # pad slots hold values no query reads
        for reference, written in zip(*caches):
            difference = (reference[:, :, slots] - written[:, :, slots]).abs().amax(dim=(1, 3))
            assert difference[kept].max() <= ATOL
        return expected
    return run


def _torch_only(decoder):
    clone = object.__new__(type(decoder))
    clone.__dict__.update(decoder.__dict__, executor=None, precision=None)
    return clone


@pytest.mark.parametrize("gated", [False, True], ids=["full", "mlp-off"])
def test_executor_steps_equal_the_torch_decoder(llama, gated):
    model, _ = llama
    assert model.use_executor("onnxruntime") == "onnxruntime"
    gates = None
    if gated:
        gates = [True] * model.decoder.num_gates
        gates[1] = False
    run = _both(model, gates)
    slots = 24
    caches = (_cache(model.decoder, 2, slots), _cache(model.decoder, 2, slots))
    pads = torch.tensor([0, 3])
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    mask, positions, where = step_inputs(pads, 0, 8, slots)
    run(caches, ids, mask, positions, where, torch.tensor([7]))      # 2 rows x 8: plain ops
    for start, count in ((8, 1), (9, 3), (12, 1)):                    # decode, then drafts
        mask, positions, where = step_inputs(pads, start, count, slots)
        run(caches, ids[:, :count], mask, positions, where, torch.arange(count))
    one = (_cache(model.decoder, 1, slots), _cache(model.decoder, 1, slots))
    for start, count in ((0, 6), (6, 3), (9, 1)):   # one row: GroupQueryAttention, in place
        mask, positions, where = step_inputs(torch.tensor([0]), start, count, slots)
        run(one, ids[:1, :count], mask, positions, where, torch.arange(count))
    model.use_executor("torch")


@pytest.mark.parametrize("logit_positions", [[7], [0, 7]], ids=["last", "every-row-start"])
def test_batched_prefills_run_row_by_row_from_each_rows_first_token(llama, logit_positions):
    """Steps of several rows and `row_steps_from` tokens run one row at a time through the
    fused attention graph, each from its first kept token (all of it where a logit is asked
    for before that), with the torch decoder's logits and cache."""

    model, _ = llama
    model.use_executor("onnxruntime")
    executor = model.decoder.executor
    executor.sessions.clear()
    executor.row_steps_from = 8
    run, slots = _both(model), 16
    caches = (_cache(model.decoder, 3, slots), _cache(model.decoder, 3, slots))
    ids = torch.randint(3, 96, (3, 8), generator=torch.Generator().manual_seed(2))
    mask, positions, where = step_inputs(torch.tensor([0, 5, 2]), 0, 8, slots)
    calls = []
    original = executor.__class__.run
    executor.__class__.run = lambda self, *args: calls.append(args[0].shape) or \
        original(self, *args)
    try:
        run(caches, ids, mask, positions, where, torch.tensor(logit_positions))
    finally:
        executor.__class__.run = original
        executor.row_steps_from = ROW_STEPS_FROM
    widths = [8, 3, 6] if logit_positions == [7] else [8, 8, 8]
    assert calls == [(3, 8)] + [(1, width) for width in widths]
    assert [variant.fused_attention for variant, _ in executor.sessions] == [True]
    model.use_executor("torch")


def test_only_the_full_path_graph_prepacks_its_fp32_weights(llama):
    """The full path's graph holds the fp32 weights as initializers (onnxruntime prepacks
    them); a plan's graph binds the stored tensors as inputs; both give the torch steps."""
    from rbcompile.artifact.step_graph import StepVariant, build_step_graph

    model, _ = llama
    model.use_executor("onnxruntime")
    executor = model.decoder.executor
    weight = "model.layers.0.self_attn.q_proj.weight"
    gates = [False] * model.decoder.num_gates
    for variant, prepacked in ((StepVariant(), True), (executor.variant(gates), False)):
        graph, initializers, inputs = build_step_graph(
            executor.shape, variant, executor.array, prepack=prepacked)
        names = {value.name for value in graph.graph.input}
        assert (weight in initializers, weight in inputs, weight in names) == (
            prepacked, not prepacked, not prepacked)
    inputs = {value.name for value in executor.session(StepVariant())[0].get_inputs()}
    assert executor.prepack and weight not in inputs      # what the executor itself built
    model.use_executor("onnxruntime", "int4")   # its prefills run the full path, unpacked
    inputs = {value.name for value in executor.session(StepVariant())[0].get_inputs()}
    assert not executor.prepack and weight in inputs
    model.use_executor("torch")


def test_unpadded_prefill_takes_no_mask(llama):
    model, _ = llama
    model.use_executor("onnxruntime")
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    _, positions, where = step_inputs(torch.tensor([0]), 0, 5, 16)
    with_mask = model.decoder(ids, torch.ones(1, 16, dtype=torch.long), positions, where,
                              torch.tensor([4]), _cache(model.decoder, 1, 16))
    without = model.decoder(ids, None, positions, where, torch.tensor([4]),
                            _cache(model.decoder, 1, 16))
    assert torch.equal(with_mask, without)
    model.use_executor("torch")


@pytest.mark.parametrize("speculate", ["off", "ngram"])
def test_generate_through_the_executor_gives_hf_greedy_tokens(llama, speculate):
    model, eager = llama
    model.use_executor("onnxruntime")
    mask = (DECODER_PROMPTS != 0).long()
    result = model.generate(DECODER_PROMPTS, mask, max_new_tokens=10, speculate=speculate)
    assert result.tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 10)
    model.use_executor("torch")


@pytest.mark.parametrize("chunk", [16, 23])
def test_a_chunked_prefill_through_the_executor_gives_hf_greedy_tokens(llama, chunk):
    """A long prompt prefilled in chunks writes its K/V into views of one buffer (its slots so
    far): the executor binds the whole buffer, as GroupQueryAttention reads only the slots it is
    told, and the tokens are HF's."""
    from rbcompile.runtime.engine.requests import EngineRequest

    model, eager = llama
    model.use_executor("onnxruntime")
    prompt = torch.arange(3, 3 + 50) % model.hf_config["vocab_size"]
    engine = model.batch_engine(max_batch=2, prefill_chunk=chunk)
    request = engine.submit(EngineRequest(prompt.tolist(), 6))
    while engine.step():
        pass
    assert engine.stats.prefill_chunks == -(-50 // chunk)
    assert request.tokens == hf_new_tokens(eager, prompt[None], torch.ones(1, 50), 6)[0]
    model.use_executor("torch")


def test_low_precision_changes_little_on_the_tiny_model(llama):
    model, _ = llama
    mask = (DECODER_PROMPTS != 0).long()
    full = model(DECODER_PROMPTS, mask)["logits"]
    from rbcompile.artifact.step_executor import sequence_logits
    shape = model.decoder.shape
    for level in ("int8", "int4"):
        model.use_executor("onnxruntime", level)
        assert set(model.decoder.precision.values()) == {"int8", level}
        logits = sequence_logits(model.decoder, DECODER_PROMPTS, mask, shape.kv_heads,
                                 shape.head_dim, shape.layers)
        real = mask.bool()
        assert (logits[real] - full[real]).abs().max() <= 0.1 * full[real].abs().max()
    model.use_executor("torch")
    assert model.decoder.executor is None and model.decoder.precision is None


def test_executor_choice_and_its_refusals(llama, compiled_tiny):
    model, _ = llama
    gpt2 = compiled_tiny["gpt2"][0]
    assert gpt2.use_executor("auto") == "torch"
    with pytest.raises(UserError, match="cannot run this model: model type gpt2 is not one of"):
        gpt2.use_executor("onnxruntime")
    with pytest.raises(UserError, match="int4 weights need the onnxruntime executor"):
        gpt2.use_executor("auto", "int4")
    with pytest.raises(UserError, match="executor must be one of"):
        model.use_executor("tensorrt")
    assert model.use_executor("auto") == "onnxruntime"
    model.use_executor("torch")
    from rbcompile.artifact.step_graph import unsupported_reason
    config = dict(model.hf_config, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert unsupported_reason(config) == "rotary embedding type yarn"


def test_precision_runs_only_within_the_guard(llama):
    model, _ = llama
    guard = QualityGuard(0.03)
    check_precision(model.manifest, "fp32", guard)
    with pytest.raises(UserError, match="int8 weights were never measured"):
        check_precision(model.manifest, "int8", guard)
    check_precision(model.manifest, "int8", QualityGuard(0.03, allow_unmeasured=True))
    saved = model.manifest.get("precisions")
    model.manifest["precisions"] = [StoredPrecision("int4", 0.05, {}).to_json()]
    try:
        with pytest.raises(UserError, match="cost quality loss 0.050 .* over the guard's 0.03"):
            check_precision(model.manifest, "int4", guard)
        check_precision(model.manifest, "int4", QualityGuard(0.06))
    finally:
        if saved is None:
            model.manifest.pop("precisions")
        else:
            model.manifest["precisions"] = saved


def _measured(level: str, agreement: float, speedup: float) -> dict:
    """A manifest's precision entry as compile would store it."""
    return StoredPrecision(level, 0.05, {"top1_agreement": agreement},
                           ((1, speedup), (8, 1.2))).to_json()


def test_quant_drafts_at_the_level_that_pays_and_keeps_hf_greedy_tokens(llama):
    """`speculate="quant"`: the measured level with the best expected speedup drafts (not the
    one decoding), the full path verifies, the tokens are HF's; without the onnxruntime
    executor or a measured level it is a one-line error."""
    model, eager = llama
    mask = (DECODER_PROMPTS != 0).long()
    saved = model.manifest.get("precisions")
    model.manifest["precisions"] = [_measured("int8", 0.99, 2.0), _measured("int4", 0.6, 2.2),
                                    _measured("int4-fp32", 1.0, 0.9)]
    try:
        model.use_executor("onnxruntime")
        drafter = model.quant_drafter()
        assert drafter.level == "int8" and drafter.cost == 0    # promised: auto tries it
        result = model.generate(DECODER_PROMPTS, mask, max_new_tokens=10, speculate="quant")
        assert result.tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 10)
        assert result.stats.drafted > 0 and result.stats.steps_by_mode == {
            "quant": result.stats.decode_steps}
        model.use_executor("onnxruntime", "int8")    # decoding at int8: nothing faster drafts
        assert model.quant_drafter() is None
        model.use_executor("torch")
        with pytest.raises(UserError, match="speculate='quant' needs the onnxruntime executor"):
            model.generate(DECODER_PROMPTS, mask, max_new_tokens=4, speculate="quant")
    finally:
        model.use_executor("torch")
        if saved is None:
            model.manifest.pop("precisions")
        else:
            model.manifest["precisions"] = saved


@pytest.mark.real
def test_smollm2_executor_reproduces_the_shipped_weights_and_hf_tokens():
    """Real weights: SmolLM2-135M (a GGUF of Q4_1 blocks and a Q8_0 head) cut to 4 layers:
    the int4 level's weights are the shipped values exactly, and greedy decoding through the
    executor at fp32 and at int4-fp32 (those blocks, fp32 activations) gives HF's tokens, with
    int4-fp32's logits as close to the torch decoder's as fp32 summation order allows."""
    from transformers import AutoTokenizer

    from rbcompile.artifact.models import load_hf_model, resolve_checkpoint
    from rbcompile.artifact.packed_weights import pack
    from rbcompile.artifact.step_executor import sequence_logits
    from rbcompile.kernels.int_weights import dequantize

    path = resolve_checkpoint("smollm2-135m")
    eager = load_hf_model(path)
    eager.model.layers = eager.model.layers[:4]
    eager.config.num_hidden_layers = 4
    model = rbcompile.load(rbcompile.compile(eager).save(__import__("tempfile").mkdtemp() + "/s"))
    model.use_executor("onnxruntime", "int4")
    executor = model.decoder.executor
    for key, level in (("model.layers.2.mlp.down_proj.weight", "int4"),
                       ("lm_head.weight", "int8")):
        assert torch.equal(dequantize(executor.array(f"{key}@{level}")), executor.tensors[key])
    # so an artifact stored int4 (compile --weights int4) holds the source's values exactly
    assert pack(dict(executor.tensors), "int4")[3].max_abs_error == 0
    batch = AutoTokenizer.from_pretrained(path)(["The capital of France is"], return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    expected = hf_new_tokens(eager, ids, mask, 12)
    shape = model.decoder.shape
    dims = (shape.kv_heads, shape.head_dim, shape.layers)
    model.use_executor("torch")
    reference = sequence_logits(model.decoder, ids, mask, *dims)
    for level in ("fp32", "int4-fp32"):
        model.use_executor("onnxruntime", level)
        assert model.generate(ids, mask, max_new_tokens=12).tokens == expected, level
        logits = sequence_logits(model.decoder, ids, mask, *dims)
        assert (logits - reference).abs().max() < 2e-5 * reference.abs().max(), level
    # int8 drafts (as if compile had measured it), the fp32 full path verifies: HF's tokens
    model.manifest["precisions"] = [_measured("int8", 0.95, 2.0)]
    model.use_executor("onnxruntime", "fp32")
    result = model.generate(ids, mask, max_new_tokens=12, speculate="quant")
    assert result.tokens == expected and result.stats.accepted > 0


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_other_llama_family_decoders_generate_hf_tokens(model_type):
    """Qwen 2 (biases on q / k / v) and Mistral (no window) through the executor."""
    import transformers

    config = getattr(transformers, {"qwen2": "Qwen2Config", "mistral": "MistralConfig"}[model_type])(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = rbcompile.compile(eager)
    assert model.use_executor("auto") == "onnxruntime"
    assert model.decoder.executor.qkv_bias == (model_type == "qwen2")
    mask = (DECODER_PROMPTS != 0).long()
    result = model.generate(DECODER_PROMPTS, mask, max_new_tokens=8)
    assert result.tokens == hf_new_tokens(eager, DECODER_PROMPTS, mask, 8)


def test_weights_auto_resolves_to_the_fastest_level_within_the_guard():
    from rbcompile.artifact.executors import resolve_weights

    def level(name, loss, *speedups):
        return StoredPrecision(name, loss, {}, tuple(enumerate(speedups, 1))).to_json()
    manifest = {"precisions": [level("int8", 0.05, 2.0), level("int4", 0.05, 2.1),
                               level("int4-fp32", 0.0, 1.4, 0.8)]}
    assert resolve_weights(manifest, "auto", QualityGuard(0.03)) == "int4-fp32"
    assert resolve_weights(manifest, "auto", QualityGuard(0.06)) == "int4"
    assert resolve_weights(manifest, "int8", QualityGuard(0.0)) == "int8"   # asked: unchanged
    assert resolve_weights({"precisions": [level("int4", 0.0)]}, "auto", QualityGuard()) == "fp32"
    assert resolve_weights({"precisions": [level("int4", 0.0, 0.9)]}, "auto",
                           QualityGuard()) == "fp32"
    stored = StoredPrecision.from_json(manifest["precisions"][2])
    assert stored.speedup == 1.4 and stored.fp32_from_rows == 2


def test_steps_of_more_rows_than_a_level_pays_for_run_fp32(tiny_checkpoints):
    """Where compile timed a level no faster than fp32 from some batch size, the executor
    runs those steps at fp32: their logits are the fp32 graph's, the smaller steps' the
    level's."""
    from rbcompile.artifact.step_executor import sequence_logits

    model = rbcompile.compile(tiny_checkpoints["llama"], precisions=("int4",))
    stored = StoredPrecision.from_json(model.manifest["precisions"][0])
    model.manifest["precisions"] = [StoredPrecision("int4", stored.decoder_quality_loss,
                                                    stored.heldout, ((1, 2.0), (2, 0.5))).to_json()]
    shape = model.decoder.shape
    dims = (shape.kv_heads, shape.head_dim, shape.layers)
    mask = (DECODER_PROMPTS != 0).long()
    one, two = DECODER_PROMPTS[:1, :4], DECODER_PROMPTS[:2, :4]
    logits = {}
    for level in ("fp32", "int4"):
        model.use_executor("onnxruntime", level)
        model.decoder.executor.full_precision_from = None
        logits[level] = [sequence_logits(model.decoder, ids, mask[:len(ids), :4], *dims)
                         for ids in (one, two)]
    assert model.decoder.executor.full_precision_rows == 2
    assert torch.allclose(logits["int4"][1], logits["fp32"][1], atol=1e-5)
    assert not torch.allclose(logits["int4"][0], logits["fp32"][0], atol=1e-4)
