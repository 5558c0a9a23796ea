"""Task heads and the RoBERTa / DistilBERT encoders (issue 19): classifier heads stay in the
artifact (`logits` next to `last_hidden_state`, label names kept), `rbcompile run` prints the
label, an unknown head is a one-line refusal, calibration and `curve` use the artifact's own
head, and the new encoder records compile with full-path parity and exact skips."""
import json

import pytest
import torch

import rbcompile
from rbcompile.frontend.cli import main

from conftest import labelled_words, random_batch, tiny_config
from shared import (
    LABELS,
    assert_parity,
    eager,
    make_encoder,
    padded_batch,
    reference_without,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    cases = {("bert", "SequenceClassification"), ("roberta", "SequenceClassification"),
             ("distilbert", "SequenceClassification"), ("bert", "TokenClassification")}
    return {case: save_checkpoint(make_encoder(*case), root / "-".join(case)) for case in cases}


@pytest.fixture(scope="module")
def bert_classifier(checkpoints):
    return rbcompile.compile(checkpoints["bert", "SequenceClassification"])


@pytest.mark.parametrize("model_type,head", [("bert", "SequenceClassification"),
                                             ("roberta", "SequenceClassification"),
                                             ("distilbert", "SequenceClassification"),
                                             ("bert", "TokenClassification")])
def test_classifier_checkpoint_keeps_its_head(checkpoints, bert_classifier, model_type, head):
    from rbcompile.artifact.models import load_hf_model

    path = checkpoints[model_type, head]
    compiled = (bert_classifier if (model_type, head) == ("bert", "SequenceClassification")
                else rbcompile.compile(path))
    model = load_hf_model(path)
    assert type(model).__name__.endswith(f"For{head}")
    assert compiled.output_names == ["logits", "last_hidden_state"]
    assert compiled.labels == ["negative", "neutral", "positive"]
    assert compiled.task_head == ("sequence-classification" if head.startswith("Sequence")
                                  else "token-classification")
    assert compiled.manifest["architecture"]["class"] == type(model).__name__
    assert_parity(compiled, model, model_type)
    ids, mask = padded_batch(model_type, 2, 9)
    logits = compiled(ids, mask)["logits"]
    assert logits.shape == ((2, 3) if head.startswith("Sequence") else (2, 9, 3))


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_encoder_records_parity_and_exact_skips(model_type):
    model = make_encoder(model_type)
    compiled = rbcompile.compile(model)
    assert compiled.manifest["architecture"]["model_type"] == model_type
    assert compiled.task_head is None and compiled.labels is None
    assert compiled.max_positions == 64
    assert_parity(compiled, model, model_type)
    prunable = [r for r in compiled.regions if r["kind"] == "prunable"]
    assert len(prunable) == 4 and all(r["unit_kind"] == "layer" for r in prunable)  # post-LN
    ids, mask = padded_batch(model_type, 2, 13)
    full = eager(model, ids, mask)
    for region in prunable:
        gates = [True] * compiled.num_gates
        gates[region["gate"]] = False
        out = compiled(ids, mask, gates=gates)
        expected = eager(reference_without(model, region), ids, mask)
        assert max((out[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
        assert max((out[k] - full[k]).abs().max().item() for k in full) > 1e-4


def test_classifier_artifact_saved_and_loaded(bert_classifier, tmp_path):
    loaded = rbcompile.load(bert_classifier.save(tmp_path / "clf"))
    assert loaded.labels == bert_classifier.labels and loaded.task_head == "sequence-classification"
    ids, mask = random_batch(2, 11)
    assert torch.equal(loaded(ids, mask)["logits"], bert_classifier(ids, mask)["logits"])
    config = json.loads((tmp_path / "clf" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}


def test_run_prints_label_and_probability(checkpoints, tmp_path, capsys):
    out = tmp_path / "clf"
    assert main(["compile", str(checkpoints["bert", "SequenceClassification"]), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "sequence-classification head, 3 labels: negative, neutral, positive" in capsys.readouterr().out
    assert main(["run", str(out), "--text", "the cat was here", "--text", "a dog"]) == 0
    lines = capsys.readouterr().out.splitlines()
    compiled = rbcompile.load(out)
    batch = compiled.tokenizer(["the cat was here", "a dog"], return_tensors="pt", padding=True)
    probs = compiled(batch["input_ids"], batch["attention_mask"])["logits"].softmax(-1)
    for line, row in zip(lines, probs):
        assert line.startswith("'")
        assert line.endswith(f": {LABELS[int(row.argmax())]} (p={row.max():.3f})")
    assert "path full" in lines[2]


def test_run_prints_a_label_per_token(checkpoints, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["compile", str(checkpoints["bert", "TokenClassification"]), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out), "--text", "the cat was here"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("'the cat was here': the/") and line.count("(") == 4


def test_unknown_head_is_a_one_line_refusal(tmp_path, capsys):
    from transformers import AutoModelForQuestionAnswering

    torch.manual_seed(0)
    folder = save_checkpoint(AutoModelForQuestionAnswering.from_config(tiny_config("bert")),
                             tmp_path / "qa")
    capsys.readouterr()
    assert main(["compile", str(folder), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("rbcompile: error: unsupported task head: BertForQuestionAnswering")
    assert "*ForSequenceClassification" in err[0] and "*ForCausalLM" in err[0]
    assert not (tmp_path / "out").exists()
    from transformers import AutoModelForMultipleChoice

    from rbcompile.errors import UserError

    with pytest.raises(UserError, match="BertForMultipleChoice"):
        rbcompile.compile(AutoModelForMultipleChoice.from_config(tiny_config("bert")))


def test_calibration_and_curve_use_the_artifact_head(checkpoints, tmp_path, capsys):
    path = checkpoints["bert", "SequenceClassification"]
    labelled = tmp_path / "labelled.jsonl"
    labelled_words(labelled, lines=60)
    compiled = rbcompile.compile(path, calib=labelled, calib_samples=40, calib_seq=16)
    calibration = compiled.manifest["calibration"]
    assert calibration["loss"] == "its sequence-classification head: cross-entropy on the labels"
    assert "accuracy" in calibration["base"] and compiled.plans
    art = compiled.save(tmp_path / "art")
    assert main(["curve", str(art), "--data", str(labelled), "--samples", "20", "--seq", "16",
                 "--rounds", "1", "-o", str(tmp_path / "curve")]) == 0
    result = json.loads((tmp_path / "curve" / "curve.json").read_text())
    assert result["metric"] == "accuracy"
    assert all("top1_agreement" in row for row in result["rows"])
    capsys.readouterr()
    head = tmp_path / "head.safetensors"
    assert main(["curve", str(art), "--classifier", str(head)]) == 2
    assert "its own sequence-classification head" in capsys.readouterr().err
    with pytest.raises(rbcompile.errors.UserError, match="--calib-head is for headless"):
        rbcompile.compile(path, calib=labelled, calib_head=head)


def test_token_classifier_calibrates_on_kl_to_the_full_path(checkpoints, calib_file):
    compiled = rbcompile.compile(checkpoints["bert", "TokenClassification"], calib=calib_file,
                                 calib_samples=8, calib_seq=16, width_levels=())
    assert compiled.manifest["calibration"]["loss"].endswith("KL divergence to the full path's "
                                                              "class distribution")
    assert compiled.manifest["calibration"]["base"] == {"loss": 0.0, "top1_agreement": 1.0}


def test_deberta_v2_refusal_names_the_missing_piece():
    from rbcompile.artifact.architectures import lookup
    from rbcompile.errors import UserError

    with pytest.raises(UserError) as error:
        lookup({"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"]})
    message = str(error.value)
    assert "\n" not in message and "model_type='deberta-v2'" in message
    assert "in place" in message and "functionalises in-place ops" in message


def test_edited_labels_in_the_manifest_are_refused(bert_classifier, tmp_path):
    from rbcompile.artifact import manifest as manifests
    from rbcompile.errors import UserError

    folder = bert_classifier.save(tmp_path / "clf")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["architecture"]["labels"] = "positive"
    with pytest.raises(UserError, match="architecture.labels must be"):
        manifests.validate(manifest, folder / "manifest.json")


def test_pretraining_head_compiles_the_encoder_and_says_so(tmp_path, capsys):
    from transformers import AutoModelForMaskedLM

    torch.manual_seed(0)
    folder = save_checkpoint(AutoModelForMaskedLM.from_config(tiny_config("bert")), tmp_path / "mlm")
    capsys.readouterr()
    compiled = rbcompile.compile(folder)
    assert "BertForMaskedLM's pre-training head is not kept" in capsys.readouterr().err
    assert compiled.task_head is None and compiled.labels is None
    assert "logits" not in compiled.output_names and "last_hidden_state" in compiled.output_names
