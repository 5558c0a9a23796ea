"""Calibration sources, measured importance, verified plans and the curve (tiny models)."""
import json
import random

import pytest
import torch

import rbcompile
from conftest import WORDS
from rbcompile.calibration_data import decoder_windows, load_texts
from rbcompile.cli import main
from rbcompile.errors import UserError


def _word_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(words // 12)]
    return "\n\n".join(lines)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "words.txt"
    path.write_text(_word_text(1200))
    return path


@pytest.fixture(scope="module")
def calibrated_llama(tiny_checkpoints, calib_file):
    return rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=8,
                             calib_seq=32)


def test_sources_text_jsonl_and_default(tmp_path):
    assert load_texts("default")[0].strip()
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "one"}\n\n"two"\n')
    assert load_texts(jsonl) == ["one", "two"]


@pytest.mark.parametrize("content,message", [
    (b"", "has no text"),
    (b"  \n\n ", "has no text"),
    (b"caf\xe9 au lait", "is not UTF-8 text"),
    (b'{"text": "ok"}\n{broken', "t.jsonl:2: not JSON"),
    (b'{"label": 1}\n', 't.jsonl:1: expected a string or an object with "text"'),
])
def test_bad_sources_give_clear_errors(tmp_path, content, message):
    path = tmp_path / ("t.jsonl" if b"{" in content else "t.txt")
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_texts(path)


def test_long_texts_are_cut_into_windows(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    windows = decoder_windows(compiled.tokenizer, [_word_text(600)], seq_len=64, windows=100)
    assert windows.shape[1] == 64 and windows.shape[0] == 600 // 64
    with pytest.raises(UserError, match="fewer than one window"):
        decoder_windows(compiled.tokenizer, ["the a of"], seq_len=64, windows=4)


def test_importance_is_deterministic(calibrated_llama, tiny_checkpoints, calib_file):
    again = rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=8,
                              calib_seq=32)
    assert again.manifest["calibration"]["regions"] == calibrated_llama.manifest["calibration"]["regions"]
    regions = calibrated_llama.manifest["calibration"]["regions"]
    prunable = [r for r in calibrated_llama.regions if r["kind"] == "prunable"]
    assert set(regions) == {str(r["id"]) for r in prunable}
    assert all(0 <= v["block_influence"] <= 2 for v in regions.values())


def test_plans_respect_their_budget_and_are_verified(calibrated_llama):
    plans = calibrated_llama.plans
    assert plans[0]["budget"] == 0 and plans[0]["skip_gates"] == []
    for plan in plans:
        assert plan["skipped_share"] <= plan["budget"] + 1e-9
        assert {"loss", "perplexity", "top1_agreement"} <= set(plan["heldout"])
    assert any(plan["skip_gates"] for plan in plans)
    budget = plans[3]["budget"]
    gates = calibrated_llama.gates_for_budget(budget + 0.01)  # picks the plan at or below
    assert [i for i, g in enumerate(gates) if not g] == plans[3]["skip_gates"]


def test_plans_follow_measured_loss_per_flop(calibrated_llama):
    from rbcompile.calibrate import plan_order
    importance = calibrated_llama.manifest["calibration"]
    order = plan_order(calibrated_llama.regions, importance)
    costs = [importance["regions"][str(r["id"])]["loss_increase"] / r["prunable_share"] for r in order]
    assert costs == sorted(costs)


def test_calibration_survives_save_and_load(calibrated_llama, tmp_path):
    loaded = rbcompile.load(calibrated_llama.save(tmp_path / "a"))
    assert loaded.plans == calibrated_llama.plans
    ids = torch.randint(3, 90, (2, 10))
    assert torch.equal(loaded(ids, budget=0.3)["logits"], calibrated_llama(ids, budget=0.3)["logits"])


def test_curve_writes_json_png_and_table(calibrated_llama, tmp_path, capsys, calib_file):
    art = calibrated_llama.save(tmp_path / "art")
    data = tmp_path / "eval.txt"
    data.write_text(_word_text(600, seed=1))
    assert main(["curve", str(art), "--data", str(data), "--samples", "3", "--seq", "48",
                 "--rounds", "1", "-o", str(tmp_path / "curve")]) == 0
    table = capsys.readouterr().out
    assert "static-BI" in table and "knee: budget" in table
    result = json.loads((tmp_path / "curve" / "curve.json").read_text())
    kinds = {r["kind"] for r in result["rows"]}
    assert kinds == {"full", "plan", "static-BI"} and result["metric"] == "perplexity"
    assert (tmp_path / "curve" / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_calibration_input(tiny_checkpoints, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(tmp_path / "out"),
                 "--calib", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rbcompile: error: calibration source") and "has no text" in err[-1]
    assert not (tmp_path / "out").exists()


def test_curve_needs_calibrated_artifact(compiled_tiny, tmp_path, capsys):
    compiled, _ = compiled_tiny["llama"]
    art = compiled.save(tmp_path / "plain")
    assert main(["curve", str(art)]) == 2
    assert "compile it with --calib" in capsys.readouterr().err
