"""Calibration sources, measured importance, verified plans and the curve (tiny models)."""
import json

import pytest
import torch

import rbcompile
from rbcompile.calibration_data import decoder_windows, load_texts
from rbcompile.errors import UserError
from rbcompile.frontend.cli import main

from conftest import unguarded, word_text


@pytest.fixture(scope="module")
def calibrated_llama(calibrated_tiny):
    return calibrated_tiny["llama"]


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
    windows = decoder_windows(compiled.tokenizer, [word_text(600)], seq_len=64, windows=100)
    assert windows.shape[1] == 64 and windows.shape[0] == 600 // 64
    with pytest.raises(UserError, match="fewer than one window"):
        decoder_windows(compiled.tokenizer, ["the a of"], seq_len=64, windows=4)


def test_windows_start_with_bos_when_the_tokenizer_adds_one():
    class Words:  # starts every sequence with BOS, as Gemma's tokenizer does
        bos_token_id, eos_token_id = 1, 2

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1] * add_special_tokens + [3 + len(w) for w in text.split()]}
    ids = decoder_windows(Words(), ["a bb ccc dddd"] * 3, seq_len=4, windows=3)
    assert ids.tolist() == [[1, 4, 5, 6], [1, 7, 2, 4], [1, 5, 6, 7]]


def test_importance_is_deterministic(calibrated_llama, tiny_checkpoints, calib_file):
    again = rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=8,
                              calib_seq=32)
    assert again.manifest["calibration"]["width"] == calibrated_llama.manifest["calibration"]["width"]
    assert again.manifest["calibration"]["regions"] == calibrated_llama.manifest["calibration"]["regions"]
    regions = calibrated_llama.manifest["calibration"]["regions"]
    prunable = [r for r in calibrated_llama.regions if r["kind"] == "prunable"]
    assert set(regions) == {str(r["id"]) for r in prunable}
    assert all(0 <= v["block_influence"] <= 2 for v in regions.values())


def test_plans_respect_their_budget_and_are_verified(calibrated_llama):
    plans = calibrated_llama.plans
    assert plans[0].budget == 0 and plans[0].skip_gates == ()
    for plan in plans:
        assert plan.skipped_share <= plan.budget + 1e-9
        assert {"loss", "perplexity", "top1_agreement"} <= set(plan.heldout)
    assert any(plan.skip_gates for plan in plans)
    budget = plans[3].budget
    gates = calibrated_llama.gates_for_budget(budget + 0.01)  # picks the plan at or below
    assert [i for i, g in enumerate(gates) if not g] == list(plans[3].skip_gates)


def test_calib_budgets_make_only_those_plans(tiny_checkpoints, calib_file):
    """`calib_budgets`: plans for those budgets only (the greedy search stops at the largest);
    a budget outside (0, 1] is a UserError before any tracing."""
    with pytest.raises(UserError, match=r"calibration budgets must be in \(0, 1\], got \[0.1, 1.5\]"):
        rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_budgets=[1.5, 0.1])
    compiled = rbcompile.compile(tiny_checkpoints["llama"], calib=calib_file, calib_samples=4,
                                 calib_seq=16, width_levels=(), calib_budgets=[0.25, 0.1])
    assert [plan.budget for plan in compiled.plans] == [0.0, 0.1, 0.25]
    assert all(plan.skipped_share <= plan.budget + 1e-9 for plan in compiled.plans)


def test_greedy_search_measures_moves_in_context_and_respects_budget():
    from rbcompile.compiler.calibrate import greedy_trajectory
    # (width or 0, share saved, skip-alone loss increase) per gate
    states = {0: [(1.0, 0, 0), (0.5, 0.125, 0.01), (0.0, 0.25, 1.0)],
              1: [(1.0, 0, 0), (0.5, 0.125, 0.01), (0.0, 0.25, 0.02)],
              2: [(1.0, 0, 0), (0.0, 0.25, 5.0)]}
    measured = []

    def evaluate(choice):  # additive, except skipping 1 costs a lot once 0 is narrowed
        measured.append(dict(choice))
        loss = {0: {0.5: 0.01, 0.0: 1.0}, 1: {0.5: 0.01, 0.0: 0.02}, 2: {0.0: 5.0}}
        total = sum(loss[g][w] for g, w in choice.items())
        return total + (3.0 if choice.get(1) == 0.0 and 0 in choice else 0.0)

    trajectory = greedy_trajectory(states, evaluate, max_budget=0.5, candidates=3)
    saved = [s for s, _ in trajectory]
    assert saved == sorted(saved) and saved[-1] <= 0.5
    choices = [c for _, c in trajectory]
    assert choices[:3] == [{}, {0: 0.5}, {0: 0.5, 1: 0.5}]
    # in context, skipping 1 is expensive, so the search skips 0 instead
    assert choices[3] == {0: 0.0, 1: 0.5}
    assert measured[0] == {}


def test_calibration_survives_save_and_load(calibrated_llama, tmp_path):
    loaded = unguarded(rbcompile.load(calibrated_llama.save(tmp_path / "a")))
    assert loaded.plans == calibrated_llama.plans
    ids = torch.randint(3, 90, (2, 10))
    assert torch.equal(loaded(ids, budget=0.3)["logits"], calibrated_llama(ids, budget=0.3)["logits"])


def test_curve_writes_json_png_and_table(calibrated_llama, tmp_path, capsys, calib_file):
    art = calibrated_llama.save(tmp_path / "art")
    data = tmp_path / "eval.txt"
    data.write_text(word_text(600, seed=1))
    assert main(["curve", str(art), "--data", str(data), "--samples", "3", "--seq", "48",
                 "--rounds", "1", "-o", str(tmp_path / "curve")]) == 0
    table = capsys.readouterr().out
    assert "static-BI" in table and "knee: budget" in table
    result = json.loads((tmp_path / "curve" / "curve.json").read_text())
    kinds = {r["kind"] for r in result["rows"]}
    assert kinds == {"full", "plan", "static-BI"} and result["metric"] == "perplexity"
    assert (tmp_path / "curve" / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_decode_curve_puts_weight_levels_and_skip_plans_on_one_frontier(
        calibrated_llama, compiled_tiny, tmp_path, capsys):
    """`curve --decode`: each weight level with each calibrated plan that skips decoder MLPs,
    quality against the fp32 full path (which the executor's fp32 row equals) and decode-step
    time; each skip-only plan is compared with the lower-precision settings as fast. An
    uncalibrated artifact gets the fixed skip order; an encoder is refused."""
    data = tmp_path / "eval.txt"
    data.write_text(word_text(600, seed=1))
    art = calibrated_llama.save(tmp_path / "art")
    argv = ["curve", str(art), "--decode", "--data", str(data), "--samples", "2", "--seq", "80",
            "--rounds", "1", "-o", str(tmp_path / "curve")]
    assert main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads((tmp_path / "curve" / "decode-curve.json").read_text())
    points = result["points"]
    assert [p["level"] for p in points if p["budget"] == 0] == ["fp32", "int8", "int4", "int4-fp32"]
    skips = [p for p in points if p["level"] == "fp32" and p["budget"] > 0]
    assert skips and all(p["skipped_mlps"] > 0 for p in skips)
    assert {p["budget"] for p in points if p["level"] == "int4"} == {0.0} | {p["budget"] for p in skips}
    full = points[0]
    assert full["label"] == "fp32" and full["speedup"] == 1.0
    assert full["quality_loss"] == 0.0 and full["top1_agreement"] == 1.0
    assert [d["skip_only"] for d in result["dominance"]] == [p["label"] for p in skips]
    assert "fp32 + budget" in table and (tmp_path / "curve" / "decode-curve.png").exists()
    plain = compiled_tiny["llama"][0].save(tmp_path / "plain")
    assert main(argv[:1] + [str(plain)] + argv[2:]) == 0
    capsys.readouterr()
    budgets = {p["budget"] for p in json.loads(
        (tmp_path / "curve" / "decode-curve.json").read_text())["points"]}
    assert budgets <= {0.0, 0.05, 0.1, 0.25, 0.5} and len(budgets) > 1


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


def test_encoder_calibrates_on_a_task_head(task_bert, tiny_checkpoints, tmp_path):
    from safetensors.torch import save_file
    assert task_bert.manifest["calibration"]["loss"].startswith("task head")
    assert all("accuracy" in plan.heldout for plan in task_bert.plans)
    head = tmp_path / "head.safetensors"
    save_file({"weight": torch.randn(2, 32), "bias": torch.zeros(2)}, str(head))
    with pytest.raises(UserError, match="--calib-head needs"):
        rbcompile.compile(tiny_checkpoints["bert"], calib="default", calib_head=head)
