"""ONNX export: gates as If nodes, parity with PyTorch, skipped work, atomic and validated files."""
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

import rbcompile
from rbcompile.artifact.ort_threads import session_options
from rbcompile.frontend import onnx_export
from rbcompile.frontend.cli import main
from rbcompile.frontend.onnx_export import (
    OnnxRunner,
    export_onnx,
    validate_onnx,
    validation_settings,
)

from conftest import ARCHS, random_batch

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_onnx(compiled_tiny, tmp_path_factory):
    """arch -> (CompiledModel, .onnx path) exported without the subprocess validation."""
    folder = tmp_path_factory.mktemp("onnx")
    return {arch: (compiled, export_onnx(compiled, folder / f"{arch}.onnx", validate=False).path)
            for arch, (compiled, _) in compiled_tiny.items()}


@pytest.fixture(scope="module")
def bert_artifact(compiled_tiny, tmp_path_factory):
    return compiled_tiny["bert"][0].save(tmp_path_factory.mktemp("art") / "bert")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rbcompile: error:") and "Traceback" not in err[0]
    return err[0]


def _parity(name, compiled, path, input_ids, attention_mask) -> None:
    """ORT vs PyTorch on the three validation settings, over unpadded positions (a left-padded
    decoder row has fully masked queries there: undefined in both)."""
    runner = OnnxRunner(compiled, path)
    valid = attention_mask.bool()
    for setting, gates in validation_settings(compiled).items():
        want = compiled(input_ids, attention_mask, gates=gates)
        got = runner(input_ids, attention_mask, gates=gates)
        assert got.gates == gates and got.skipped_flops == want.skipped_flops
        diff = 0.0
        for key, value in want.items():
            keep = valid if value.shape[:2] == valid.shape else ...
            assert got[key].shape == value.shape
            diff = max(diff, (got[key][keep] - value[keep]).abs().max().item())
        print(f"\n{name}, {setting}: max abs diff {diff:.2g}", end="")  # shown with -s
        assert diff <= ATOL, (name, setting, diff)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_parity_three_gate_settings_two_shapes(tiny_onnx, arch):
    compiled, path = tiny_onnx[arch]
    for batch, seq in ((3, 11), (1, 5)):  # neither is the traced 2 x 16: dynamic axes
        _parity(f"tiny {arch} {batch}x{seq}", compiled, path, *random_batch(batch, seq))


def test_a_nan_in_the_weights_passes_through_the_attention_as_in_torch(tmp_path):
    """The export's attention turns the NaN of a query row whose every key is masked into 0, as
    torch does; a NaN the weights carry passes through, as in torch (it was zeroed too)."""
    from conftest import make_tiny_model

    eager = make_tiny_model("llama")
    with torch.no_grad():
        eager.model.layers[0].self_attn.v_proj.weight[3, :] = float("nan")
    compiled = rbcompile.compile(eager)
    path = export_onnx(compiled, tmp_path / "nan.onnx", validate=False).path
    input_ids, attention_mask = random_batch(2, 9)  # the second row left-padded
    gates = [True] * compiled.num_gates
    want = compiled(input_ids, attention_mask, gates=gates)["logits"]
    got = OnnxRunner(compiled, path)(input_ids, attention_mask, gates=gates)["logits"]
    valid = attention_mask.bool()
    assert torch.isnan(want[valid]).all()
    assert torch.equal(torch.isnan(got[valid]), torch.isnan(want[valid]))


def test_real_minilm_parity(minilm, tmp_path):
    compiled, _, tokenizer = minilm
    path = export_onnx(compiled, tmp_path / "minilm.onnx", validate=False).path
    batch = tokenizer(["A gripping, beautifully acted film.", "Dull."], return_tensors="pt",
                      padding=True)
    _parity("minilm-l6", compiled, path, batch["input_ids"], batch["attention_mask"])


def test_graph_has_gate_input_and_if_per_prunable_region(tiny_onnx):
    compiled, path = tiny_onnx["llama"]
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input}
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                      "gates": [compiled.num_gates]}
    assert model.graph.input[2].type.tensor_type.elem_type == onnx.TensorProto.BOOL
    assert [o.name for o in model.graph.output] == compiled.output_names
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    assert len(ifs) == compiled.num_gates
    for node in ifs:
        branches = {a.name: a.g for a in node.attribute}
        assert [n.op_type for n in branches["else_branch"].node] == ["Identity"]
        assert len(branches["then_branch"].node) > 10


def _executed_kernels(path, feeds, gate_settings) -> list[int]:
    """Node kernels onnxruntime's profiler records per run (subgraph nodes included)."""
    import onnxruntime

    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(path.parent / "profile")
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for gates in gate_settings:
        session.run(None, {**feeds, "gates": np.array(gates)})
    events = json.loads(open(session.end_profiling()).read())
    runs = [e for e in events if e.get("name") == "model_run"]
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    return [sum(run["ts"] <= k["ts"] <= run["ts"] + run["dur"] for k in kernels) for run in runs]


def test_gate_off_skips_the_region_nodes(tiny_onnx):
    compiled, path = tiny_onnx["llama"]
    input_ids, attention_mask = random_batch(2, 8)
    feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
    n = compiled.num_gates
    settings = [[True] * n, [g != 2 for g in range(n)], [False] * n]
    all_on, one_off, all_off = _executed_kernels(path, feeds, settings)
    print(f"\nllama kernels executed: all on {all_on}, gate 2 (layer 1 attention) off {one_off}, "
          f"all off {all_off}")
    assert all_off < one_off < all_on
    assert all_on - one_off >= 20  # the attention region's nodes (its else branch: 1 Identity)
    assert all_off < all_on / 3


def test_validation_in_subprocess_and_failure_leaves_nothing(tiny_onnx, tmp_path, monkeypatch):
    compiled, path = tiny_onnx["bert"]
    diffs = validate_onnx(compiled, path, None, dynamic=True)
    assert list(diffs) == list(validation_settings(compiled))
    assert max(diffs.values()) <= ATOL

    import onnx_ir
    monkeypatch.setattr(onnx_export, "_to_onnx", lambda *args: torch.onnx.ONNXProgram(
        onnx_ir.load(str(path)), None))
    monkeypatch.setattr(onnx_export, "ATOL", -1.0)  # no diff passes
    with pytest.raises(rbcompile.UserError, match=r"ONNX validation failed: all on: \w+ differs by"):
        export_onnx(compiled, tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []


def test_validation_does_not_import_from_the_working_directory(tiny_onnx, tmp_path, monkeypatch):
    """The validation subprocess runs in a folder of its own: a package of the caller's working
    directory (a checkout's kernels/, here a fake onnxruntime) never shadows an installed one,
    whatever the Python version (PYTHONSAFEPATH is 3.11+)."""
    compiled, path = tiny_onnx["bert"]
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "__init__.py").write_text(
        "raise ImportError('the working directory shadows onnxruntime')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    diffs = validate_onnx(compiled, path, None, dynamic=False)
    assert max(diffs.values()) <= ATOL


@pytest.fixture(scope="module")
def calibrated_bert(tiny_checkpoints, calib_file, tmp_path_factory):
    """Tiny BERT with width levels and plans, as an artifact folder."""
    compiled = rbcompile.compile(tiny_checkpoints["bert"], calib=calib_file, calib_samples=8,
                                 calib_seq=32)
    return compiled.save(tmp_path_factory.mktemp("cal") / "bert")


def test_cli_export_bakes_widths_and_run_uses_the_file(calibrated_bert, tmp_path, capsys):
    out = tmp_path / "sub" / "bert.onnx"
    assert main(["export-onnx", str(calibrated_bert), "-o", str(out), "--budget", "0.3",
                 "--opset", "18"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: opset 18, 4 If nodes" in printed and "widths of budget 0.3" in printed
    assert "all on" in printed and "budget 0.3 plan" in printed
    model = rbcompile.load(calibrated_bert)
    widths = model.plan_for_budget(0.3)[1]
    assert widths and min(widths) < 1
    metadata = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(metadata["rbcompile.widths"]) == widths
    input_ids, attention_mask = random_batch(2, 7)
    got = OnnxRunner(model, out)(input_ids, attention_mask, budget=0.3)
    want = model(input_ids, attention_mask, budget=0.3)
    assert got.widths == want.widths and got.skipped_flops == want.skipped_flops > 0
    assert (got["last_hidden_state"] - want["last_hidden_state"]).abs().max() <= ATOL

    text = ["--text", "the first time", "--text", "a new one"]
    assert main(["run", str(calibrated_bert), *text, "--budget", "0.3"]) == 0
    torch_out = capsys.readouterr().out
    assert main(["run", str(calibrated_bert), *text, "--budget", "0.3", "--engine",
                 "onnxruntime", "--onnx", str(out)]) == 0
    assert capsys.readouterr().out == torch_out
    assert main(["run", str(calibrated_bert), *text, "--engine", "onnxruntime",
                 "--onnx", str(out)]) == 2
    assert "bakes the widths" in _error_line(capsys)


def test_cli_run_onnxruntime_exports_to_a_temporary_file(bert_artifact, capsys):
    text = ["--text", "the first time", "--text", "a new one"]
    assert main(["run", str(bert_artifact), *text, "--budget", "0.3"]) == 0
    torch_out = capsys.readouterr().out
    assert main(["run", str(bert_artifact), *text, "--budget", "0.3",
                 "--engine", "onnxruntime"]) == 0
    assert capsys.readouterr().out == torch_out


@pytest.mark.parametrize("damage,message", [
    ("weights.safetensors", "missing weights.safetensors"),
    ("graph.json", "sha256 does not match the manifest"),
    ("manifest.json", "corrupt JSON"),
    ("model.py", "missing model.py"),
])
def test_export_damaged_artifact(bert_artifact, tmp_path, capsys, damage, message):
    art = tmp_path / "art"
    shutil.copytree(bert_artifact, art)
    target = art / damage
    if damage in ("weights.safetensors", "model.py"):
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:100])
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export-onnx", str(art), "-o", str(out / "model.onnx")]) == 2
    assert message in _error_line(capsys)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("argv,message", [
    (["--opset", "5"], "opset must be an integer in [18, 23], got 5"),
    (["--opset", "x"], "argument --opset: invalid int value: 'x'"),
    (["--budget", "2"], "budget must be in [0, 1]"),
    (["--budget", "lots"], "budget must be a number"),
])
def test_export_bad_options(bert_artifact, tmp_path, capsys, argv, message):
    assert main(["export-onnx", str(bert_artifact), "-o", str(tmp_path / "m.onnx"), *argv]) == 2
    assert message in _error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,message", [
    (["--onnx", "{tmp}/m.onnx"], "--onnx needs --engine onnxruntime"),
    (["--engine", "onnxruntime", "--onnx", "{tmp}/m.onnx"], "no such ONNX file"),
    (["--engine", "tvm"], "argument --engine: invalid choice: 'tvm'"),
])
def test_run_bad_engine_options(bert_artifact, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["run", str(bert_artifact), "--text", "the one", *argv]) == 2
    assert message in _error_line(capsys)


def test_runner_refuses_another_artifact_or_a_corrupt_file(tiny_onnx, tmp_path):
    compiled, _ = tiny_onnx["bert"]
    with pytest.raises(rbcompile.UserError, match="not exported from this artifact"):
        OnnxRunner(compiled, tiny_onnx["gpt2"][1])
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(rbcompile.UserError, match="cannot load the ONNX model"):
        OnnxRunner(compiled, tmp_path / "bad.onnx")

