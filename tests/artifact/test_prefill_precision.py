"""Prompts prefilled at a precision of their own (artifact/executors.py `prefill`, the step
graph's "int8-token" linears): only a prompt's prefill runs it, never a decode or verify step or
a step that scores the prompt; compile measures it with every decode level; the guard bounds
the pair that runs; a malformed manifest entry is refused."""
import copy

import pytest
import torch

import rbcompile
from rbcompile.artifact.executors import (
    StoredPrefill,
    check_precision,
    level_loss,
    resolve_prefill,
    stored_prefills,
)
from rbcompile.artifact.guard import QualityGuard
from rbcompile.artifact.manifest import validate
from rbcompile.artifact.packed_weights import level_precision
from rbcompile.artifact.step_executor import FULL_PRECISION_FROM
from rbcompile.errors import UserError


@pytest.fixture(scope="module")
def measured(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama compiled with int8 weights measured (and so the int8 prefill), saved and
    loaded back."""
    compiled = rbcompile.compile(tiny_checkpoints["llama"], precisions=("int8",))
    return rbcompile.load(compiled.save(tmp_path_factory.mktemp("prefill") / "llama"))


def _step(model, tokens: int, scored: bool):
    """Logits of a `tokens`-token prompt step, at every position if `scored`, else the last."""
    shape, vocab = model.decoder.shape, model.hf_config["vocab_size"]
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    cache = [torch.zeros(1, shape.kv_heads, tokens, shape.head_dim)
             for _ in range(2 * shape.layers)]
    slots = torch.arange(tokens)
    logits = slots if scored else torch.tensor([tokens - 1])
    return model.decoder(ids, torch.ones_like(ids), slots[None], slots, logits, cache)


def test_only_a_prompts_prefill_runs_at_the_prefill_precision(measured):
    prompt = FULL_PRECISION_FROM + 8
    measured.use_executor("onnxruntime", "fp32")
    full = {(tokens, scored): _step(measured, tokens, scored)
            for tokens in (prompt, FULL_PRECISION_FROM - 1) for scored in (False, True)}
    measured.use_executor("onnxruntime", "fp32", prefill="int8")
    assert measured.decoder.prefill == "int8"
    prefilled = _step(measured, prompt, False)
    assert not torch.equal(prefilled, full[prompt, False])          # the int8 GEMMs ran
    assert (prefilled - full[prompt, False]).abs().max() < 0.1 * full[prompt, False].abs().max()
    assert torch.equal(_step(measured, prompt, True), full[prompt, True])    # scoring: fp32
    for scored in (False, True):   # drafts' verify steps and decode steps: fp32
        assert torch.equal(_step(measured, FULL_PRECISION_FROM - 1, scored),
                           full[FULL_PRECISION_FROM - 1, scored])
    measured.use_executor("onnxruntime", "fp32")
    assert torch.equal(_step(measured, prompt, False), full[prompt, False])
    with pytest.raises(UserError, match="an int8 prefill needs the onnxruntime executor"):
        measured.use_executor("torch", prefill="int8")
    with pytest.raises(UserError, match="prefill weights must be one of fp32, int8"):
        measured.use_executor("onnxruntime", prefill="int4")


def test_the_prefill_computes_the_same_whichever_graph_was_built_first(measured):
    """The int8 decode level and the int8 prefill smooth one norm's output by different
    factors, each folded into a copy of the norm's weight: neither graph may read the other's."""
    prompt = FULL_PRECISION_FROM + 8
    results = []
    for decode_first in (False, True):
        measured.decoder.step_executor = None   # a fresh executor: no session built yet
        measured.use_executor("onnxruntime", "fp32", prefill="int8")
        executor = measured.decoder.executor
        if decode_first:   # the int8 decode step's graphs
            executor.prepare(level_precision("int8", executor.linear_weights()))
        results.append(_step(measured, prompt, False))
    assert torch.equal(results[0], results[1])
    measured.use_executor("onnxruntime", "fp32")


def test_compile_measures_the_prefill_with_every_decode_level(measured):
    stored = stored_prefills(measured.manifest)["int8"]
    assert set(stored.losses) == {"fp32", "int8"}
    assert all(loss >= 0 for loss in stored.losses.values())
    assert 0 < stored.heldout["top1_agreement"] <= 1 and stored.heldout["perplexity"] > 1
    assert stored.speedup is not None and stored.speedup > 0 and stored.tokens >= 64
    assert level_loss(measured.manifest, "int8", "int8") == stored.losses["int8"]
    assert level_loss(measured.manifest, "fp32", "fp32") == 0.0
    assert level_loss(measured.manifest, "int4", "int8") is None   # never measured together
    validate(measured.manifest, "here")


def test_the_guard_bounds_the_prefill_and_the_decode_level_together():
    manifest = {"precisions": [], "prefill_precisions": [StoredPrefill(
        "int8", {"fp32": 0.02, "int8": 0.05}, {}, 1.7, 512).to_json()]}
    check_precision(manifest, "fp32", QualityGuard(0.02), "int8")
    with pytest.raises(UserError, match="fp32 weights after an int8 prefill cost quality loss "
                                        "0.020 .* over the guard's 0.01"):
        check_precision(manifest, "fp32", QualityGuard(0.01), "int8")
    with pytest.raises(UserError, match="int4 weights after an int8 prefill were never measured"):
        check_precision(manifest, "int4", QualityGuard(1.0), "int8")
    assert resolve_prefill(manifest, "auto", "fp32", QualityGuard(0.02)) == "int8"
    assert resolve_prefill(manifest, "auto", "int8", QualityGuard(0.02)) == "fp32"
    assert resolve_prefill(manifest, "auto", "int4", QualityGuard(1.0)) == "fp32"
    slower = copy.deepcopy(manifest)
    slower["prefill_precisions"][0]["speedup"] = 0.9
    assert resolve_prefill(slower, "auto", "fp32", QualityGuard(1.0)) == "fp32"
    assert resolve_prefill(manifest, "fp32", "fp32", QualityGuard(0.0)) == "fp32"
    check_precision({}, "fp32", QualityGuard(0.0))   # the full path needs no measurement
    with pytest.raises(UserError, match="after an int8 prefill were never measured"):
        check_precision({}, "fp32", QualityGuard(0.0), "int8")


def test_the_linears_input_ranges_are_stored_and_smooth_int8(measured):
    """compile records each linear's input channel maxima on calibration text; the artifact
    stores them (listed with a sha256) and loads them back; the int8 prefill's linears and the
    int8 decode level's are smoothed by them, int4's are not."""
    from safetensors.torch import load_file

    from rbcompile.artifact.manifest import ACTIVATION_FILE, read

    folder = measured.tokenizer_dir
    assert read(folder)["decoder"]["activation_max"] == ACTIVATION_FILE
    assert ACTIVATION_FILE in read(folder)["files"]["sha256"]
    maxima = measured.decoder.activation_max
    stored = load_file(str(folder / ACTIVATION_FILE))
    assert maxima.keys() == stored.keys() and all(torch.equal(maxima[k], stored[k]) for k in maxima)
    measured.use_executor("onnxruntime", "fp32", prefill="int8")
    linears = measured.decoder.executor.linear_weights()
    assert set(linears) - {"lm_head.weight"} <= set(maxima)
    hidden = measured.hf_config["hidden_size"]
    assert maxima[linears[0]].shape == (hidden,) and (maxima[linears[0]] > 0).all()
    executor = measured.decoder.executor
    for level in ("int8-token", "int8"):   # the int8 prefill's and the int8 decode level's
        packed = executor.array(f"{linears[0]}@{level}")
        assert packed.inverse_smooth is not None and packed.inverse_smooth.shape == (hidden,)
    assert executor.array(f"{linears[0]}@int4").inverse_smooth is None   # blocks kept as given


def test_plans_are_unmeasured_after_an_int8_prefill(measured):
    """A plan's losses were measured with fp32 prefills: with an int8 prefill its loss path
    has no measurement, so the guard runs it only where unmeasured plans may run."""
    from rbcompile.artifact.guard import DECODER, decoder_path, guard_budget
    from rbcompile.artifact.plans import StoredPlan

    plans = [StoredPlan(0.0), StoredPlan(0.25, (1,), decoder_quality_loss=0.01,
                                         precision_losses=(("int8", 0.02),))]
    assert plans[1].loss(decoder_path("fp32")) == 0.01
    assert plans[1].loss(decoder_path("int8")) == 0.02
    for level in ("fp32", "int8"):
        assert plans[1].loss(decoder_path(level, "int8")) is None
    measured.use_executor("onnxruntime", "fp32", prefill="int8")
    path = measured.loss_path(DECODER)
    assert path == decoder_path("fp32", "int8")
    assert guard_budget(plans, 0.25, QualityGuard(1.0), path).budget == 0.0
    assert guard_budget(plans, 0.25, QualityGuard(1.0), DECODER).budget == 0.25
    measured.use_executor("onnxruntime", "fp32")
    assert measured.loss_path(DECODER) == DECODER


def test_auto_levels_are_resolved_together():
    """--weights auto with an explicit prefill picks the fastest level allowed with that
    prefill; both auto: the weights first, then the prefill for them; neither runs below fp32
    where onnxruntime does not run the steps."""
    from rbcompile.artifact.executors import StoredPrecision, resolve_levels

    manifest = {"precisions": [StoredPrecision("int8", 0.03, {}, ((1, 2.0),)).to_json()],
                "prefill_precisions": [StoredPrefill(
                    "int8", {"fp32": 0.03, "int8": 0.06}, {}, 1.7, 512).to_json()]}
    guard = QualityGuard(0.05)
    assert resolve_levels(manifest, "auto", "int8", guard, True) == ("fp32", "int8")
    assert resolve_levels(manifest, "auto", "fp32", guard, True) == ("int8", "fp32")
    assert resolve_levels(manifest, "auto", "auto", guard, True) == ("int8", "fp32")
    assert resolve_levels(manifest, "fp32", "auto", guard, True) == ("fp32", "int8")
    assert resolve_levels(manifest, "auto", "auto", guard, False) == ("fp32", "fp32")


def test_activation_maxima_unlisted_in_the_manifest_are_refused(measured):
    from rbcompile.artifact.manifest import ACTIVATION_FILE, read

    manifest = copy.deepcopy(read(measured.tokenizer_dir))
    del manifest["files"]["sha256"][ACTIVATION_FILE]
    with pytest.raises(UserError, match=f"{ACTIVATION_FILE} must be listed with its sha256"):
        validate(manifest, "here")


def test_activation_maxima_that_do_not_fit_their_weights_are_refused(measured, tmp_path):
    """A tampered file re-hashed into the manifest still loads with a one-line error."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from rbcompile.artifact.manifest import ACTIVATION_FILE, sha256_file

    folder = shutil.copytree(measured.tokenizer_dir, tmp_path / "tampered")
    maxima = load_file(str(folder / ACTIVATION_FILE))
    name = next(iter(maxima))
    save_file({**maxima, name: -maxima[name]}, str(folder / ACTIVATION_FILE))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["sha256"][ACTIVATION_FILE] = sha256_file(folder / ACTIVATION_FILE)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=f"the activation maxima of {name} do not fit"):
        rbcompile.load(folder)


@pytest.mark.parametrize("entry", [
    {"level": "int4", "losses": {"fp32": 0.1}, "heldout": {}},
    {"level": "int8", "losses": {}, "heldout": {}},
    {"level": "int8", "losses": {"fp16": 0.1}, "heldout": {}},
    {"level": "int8", "losses": {"fp32": -1}, "heldout": {}},
    {"level": "int8", "losses": {"fp32": 0.1}, "heldout": {}, "speedup": 0},
])
def test_malformed_prefill_entries_are_refused(measured, entry):
    manifest = dict(measured.manifest, prefill_precisions=[entry])
    with pytest.raises(UserError, match="prefill_precisions must be a list"):
        validate(manifest, "here")
