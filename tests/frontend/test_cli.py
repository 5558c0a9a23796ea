"""CLI: exit codes, one-line errors without tracebacks, no half-written artifacts."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from rbcompile.frontend.cli import main


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rbcompile: error:") and "Traceback" not in err[0]
    return err[0]


def _no_artifact(parent, name="out"):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def llama_artifact(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "llama"
    assert main(["compile", str(tiny_checkpoints["llama"]), "-o", str(out)]) == 0
    return out


def test_compile_writes_complete_artifact(llama_artifact):
    names = {p.name for p in llama_artifact.iterdir()}
    assert {"manifest.json", "graph.json", "model.py", "weights.safetensors", "config.json",
            "tokenizer.json"} <= names
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    assert manifest["schema_version"] == 2 and len(manifest["source"]["sha256"]) == 64
    assert set(manifest["files"]["sha256"]) == names - {"manifest.json"}
    assert manifest["architecture"]["model_type"] == "llama"
    assert [p["pass"] for p in manifest["passes"]][0] == "canonicalize"
    kinds = {r["kind"] for r in manifest["regions"]}
    assert kinds == {"skeleton", "prunable", "cache"}
    assert all("module_path" in r and "flops_share" in r for r in manifest["regions"])
    assert [p["level"] for p in manifest["precisions"]] == ["int8", "int4", "int4-fp32"]  # at compile
    assert all(0 <= p["decoder_quality_loss"] <= 1 and "perplexity" in p["heldout"]
               for p in manifest["precisions"])


def test_inspect_table_json_and_budget(llama_artifact, capsys):
    assert main(["inspect", str(llama_artifact)]) == 0
    summary = capsys.readouterr().out
    assert "prunable regions" in summary and "model.layers.3.mlp" not in summary
    assert re.search(r"int4 weights: perplexity [\d.]+, top-1 agreement [\d.]+%, quality loss",
                     summary)
    assert re.search(r"int8 prefill: quality loss decoding at fp32 [\d.]+, int8 [\d.]+, int4 "
                     r"[\d.]+, int4-fp32 [\d.]+, [\d.]+x fp32 on a \d+-token prompt", summary)
    assert main(["inspect", str(llama_artifact), "--verbose"]) == 0
    table = capsys.readouterr().out
    assert "model.layers.3.mlp" in table and "SKIP" not in table
    assert main(["inspect", str(llama_artifact), "--budget", "0.4", "--verbose"]) == 0
    table = capsys.readouterr().out
    assert "SKIP" in table and "budget 0.4: skips" in table and "fixed skip order" in table
    assert main(["inspect", str(llama_artifact), "--budget", "0.4"]) == 0
    assert "(skips model.layers." in capsys.readouterr().out
    assert main(["inspect", str(llama_artifact), "--json", "--budget", "0.4"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert 0 < payload["budget"]["skipped_prunable_flops"] <= 0.4
    assert payload["budget"]["skipped_regions"]


def test_run_generates_text(llama_artifact, capsys):
    assert main(["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens",
                 "4", "--budget", "0.3", "--allow-unmeasured-plans"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("'the time of his' -> ")
    assert "4 tokens in" in out and "tokens/s (KV cache, speculate off)" in out
    assert "ran budget 0.3 (unmeasured)" in out


def test_run_speculates_and_samples(llama_artifact, capsys):
    argv = ["run", str(llama_artifact), "--text", "the time of the time of the", "--max-new-tokens", "6"]
    assert main(argv + ["--speculate", "ngram"]) == 0
    greedy = capsys.readouterr().out
    assert "speculate ngram" in greedy
    assert main(argv) == 0  # lossless: the same text without speculation
    assert capsys.readouterr().out.splitlines()[0] == greedy.splitlines()[0]
    sampled = [main(argv + ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]) == 0
               and capsys.readouterr().out.splitlines()[0] for _ in range(2)]
    assert sampled[0] and sampled[0] == sampled[1]  # seeded: reproducible


def test_run_votes_over_samples(llama_artifact, capsys):
    argv = ["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens", "5",
            "--consistency", "3", "--temperature", "0.9", "--seed", "2"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("'the time of his' -> ") and re.search(r"from [1-3] of 3 answers", first) and "1 prefill" in first
    assert main(argv) == 0 and capsys.readouterr().out.splitlines()[0] == first.splitlines()[0]


def test_run_weights_within_the_guard(llama_artifact, capsys):
    """--weights runs a precision only where its loss measured at compile is within
    --max-quality-loss; the executor that runs it is onnxruntime."""
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    loss = {p["level"]: p["decoder_quality_loss"] for p in manifest["precisions"]}["int4"]
    argv = ["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens", "4",
            "--weights", "int4"]
    assert main(argv + ["--max-quality-loss", str(loss / 2)]) == 2
    assert f"int4 weights cost quality loss {loss:.3f}" in _error_line(capsys)
    assert main(argv + ["--max-quality-loss", str(loss)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("'the time of his' -> ")
    assert re.search(rf"int4 weights \(quality loss {loss:.3f} measured, decode step "
                     r"[\d.]+x fp32 at batch 1.*\) on onnxruntime", captured.err)
    assert main(argv + ["--max-quality-loss", "1", "--executor", "torch"]) == 2
    assert "int4 weights need the onnxruntime executor" in _error_line(capsys)


def test_run_weights_auto_takes_the_fastest_level_the_guard_allows(llama_artifact, capsys):
    """compile times each level's decode step at 1, 2 and 8 rows; --weights auto runs the fastest
    one at batch 1 whose measured loss is within --max-quality-loss, and says which."""
    levels = json.loads((llama_artifact / "manifest.json").read_text())["precisions"]
    assert all(list(level["speedups"]) == ["1", "2", "8"] for level in levels)
    argv = ["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens", "3",
            "--weights", "auto"]
    for limit in (0.0, 10.0):
        allowed = [level for level in levels
                   if level["decoder_quality_loss"] <= limit and level["speedups"]["1"] > 1]
        expected = (max(allowed, key=lambda level: level["speedups"]["1"])["level"] if allowed
                    else "fp32")
        assert main(argv + ["--max-quality-loss", str(limit)]) == 0
        assert f"--weights auto: {expected}" in capsys.readouterr().err


def test_run_prefill_weights_within_the_guard(llama_artifact, capsys):
    """--prefill-weights int8 runs where the loss compile measured for it with the decode
    level is within --max-quality-loss, says so on one line; auto takes it where it also timed
    faster than fp32; the torch executor refuses it."""
    prefill = json.loads((llama_artifact / "manifest.json").read_text())["prefill_precisions"][0]
    assert prefill["level"] == "int8"
    assert set(prefill["losses"]) == {"fp32", "int8", "int4", "int4-fp32"}
    level, loss = max(prefill["losses"].items(), key=lambda item: item[1])   # the lossiest pair
    assert loss > 0
    argv = ["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens", "3",
            "--weights", level, "--prefill-weights"]
    assert main(argv + ["int8", "--max-quality-loss", str(loss / 2)]) == 2
    assert (f"{level} weights after an int8 prefill cost quality loss {loss:.3f}"
            in _error_line(capsys))
    assert main(argv + ["int8", "--max-quality-loss", str(loss)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("'the time of his' -> ")
    assert (f"prompts prefilled at int8 (quality loss {loss:.3f} measured with {level} decoding, "
            f"{prefill['speedup']:.2f}x fp32 on a {prefill['tokens']}-token prompt)") in captured.err
    argv[argv.index("--weights") + 1] = "fp32"
    assert main(argv + ["auto", "--max-quality-loss", "1"]) == 0
    err = capsys.readouterr().err
    assert ("prompts prefilled at int8" in err) == (prefill["speedup"] > 1)
    assert ("--prefill-weights auto: fp32" in err) == (prefill["speedup"] <= 1)
    assert main(argv + ["int8", "--max-quality-loss", "1", "--executor", "torch"]) == 2
    assert "an int8 prefill needs the onnxruntime executor" in _error_line(capsys)


def test_run_votes_decode_at_their_tiers_weights(llama_artifact, capsys):
    """--tier-weights: a 1-sample vote decodes at the level given for tier 1, within the
    guard (a level over it is a one-line error)."""
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    loss = {p["level"]: p["decoder_quality_loss"] for p in manifest["precisions"]}["int4"]
    argv = ["run", str(llama_artifact), "--text", "the time of his", "--max-new-tokens", "4",
            "--consistency", "1", "--tier-weights", "1=int4,7=int8"]
    assert main(argv + ["--max-quality-loss", "10"]) == 0
    assert "int4 weights; votes" in capsys.readouterr().out
    assert main(argv + ["--max-quality-loss", str(loss / 2)]) == 2
    assert f"int4 weights cost quality loss {loss:.3f}" in _error_line(capsys)


@pytest.mark.parametrize("flags,message", [
    (["--consistency", "3"], "--consistency 3 needs --temperature"),
    (["--tier-weights", "2=int4"], "expected 'auto' or K=LEVEL pairs"),
    (["--tier-weights", "1=int3"], "expected 'auto' or K=LEVEL pairs"),
    (["--consistency", "3", "--temperature", "0.7", "--extract", "middle"], "unknown answer extractor 'middle'"),
    (["--consistency", "3", "--temperature", "0.7", "--speculate", "ngram"], "does not combine with speculate"),
    (["--temperature", "0"], "temperature must be > 0 when sampling"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "0"], "top_k must be >= 1"),
    (["--speculate", "always"], "argument --speculate: invalid choice"),
])
def test_run_refuses_bad_generation_options(llama_artifact, capsys, flags, message):
    assert main(["run", str(llama_artifact), "--text", "the time", *flags]) == 2
    assert message in capsys.readouterr().err


def test_run_encoder_prints_embedding(tiny_checkpoints, tmp_path, capsys):
    out_dir = tmp_path / "bert"
    assert main(["compile", str(tiny_checkpoints["bert"]), "-o", str(out_dir)]) == 0
    capsys.readouterr()
    assert main(["run", str(out_dir), "--text", "the first time", "--text", "a new one"]) == 0
    out = capsys.readouterr().out
    assert "mean-pooled embedding dim 32" in out and "cosine(text 1, text 2)" in out


def test_models_lists_bundled_names(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "minilm-l6" in out and "(default)" in out


def _broken_checkpoint(tiny_checkpoints, tmp_path, how):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["gpt2"], path)
    weights = path / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        weights.write_bytes(b"\x00\x01not a safetensors file" * 10)
    elif how == "no-weights":
        weights.unlink()
    elif how == "no-config":
        (path / "config.json").unlink()
    elif how == "bad-config":
        (path / "config.json").write_text("{not json")
    elif how == "unknown-arch":
        config = json.loads((path / "config.json").read_text())
        config.update(model_type="t5", architectures=["T5ForConditionalGeneration"])
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("how,message", [
    ("truncated", "corrupt safetensors file"),
    ("garbage", "corrupt safetensors file"),
    ("no-weights", "no *.safetensors weights"),
    ("no-config", "missing config.json"),
    ("bad-config", "corrupt JSON"),
    ("unknown-arch", "unsupported architecture: model_type='t5' (T5ForConditionalGeneration); "
                     "supported: bert, "),  # the rest: every record (test_architectures.py)
])
def test_compile_bad_checkpoint(tiny_checkpoints, tmp_path, capsys, how, message):
    path = _broken_checkpoint(tiny_checkpoints, tmp_path, how)
    assert main(["compile", str(path), "-o", str(tmp_path / "out")]) == 2
    assert message in _error_line(capsys)
    _no_artifact(tmp_path)


@pytest.mark.parametrize("argv,message", [
    (["compile", "/no/such/folder", "-o", "{tmp}/out"], "no such model folder: /no/such/folder"),
    (["compile", "x", "-o", "{tmp}/out", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["inspect", "{art}", "--budget", "1.5"], "budget must be in [0, 1]"),
    (["inspect", "{art}", "--budget", "nan"], "budget must be in [0, 1]"),
    (["inspect", "{art}", "--budget", "lots"], "budget must be a number"),
    (["run", "{art}", "--text", "  "], "--text must not be empty"),
    (["inspect", "{tmp}/missing"], "no such artifact folder"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["run", "{art}", "--text", "a", "--dtype", "bf16"], "this model was compiled in float32; "
     "to run in bfloat16 compile it with --dtype bf16"),
    (["run", "{art}", "--text", "a", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["run", "{art}", "--text", "a", "--device", "tpu"], "unknown device 'tpu'"),
] + ([] if torch.cuda.is_available() else [
    (["run", "{art}", "--text", "a", "--device", "cuda"], "no CUDA device is available"),
    (["compile", "x", "-o", "{tmp}/out", "--device", "cuda"], "no CUDA device is available")]))
def test_bad_usage(llama_artifact, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, art=llama_artifact) for a in argv]
    assert main(argv) == 2
    assert message in _error_line(capsys)
    _no_artifact(tmp_path)


@pytest.mark.parametrize("damage,message", [
    ("model.py", "model.py: sha256 does not match the manifest"),
    ("graph.json", "graph.json: sha256 does not match the manifest"),
    ("weights.safetensors", "weights.safetensors: sha256 does not match the manifest"),
    ("manifest.json", "corrupt JSON"),
])
def test_run_damaged_artifact(llama_artifact, tmp_path, capsys, damage, message):
    art = tmp_path / "art"
    shutil.copytree(llama_artifact, art)
    target = art / damage
    if damage == "model.py":
        target.write_text(target.read_text().replace("return (", "import os; return (", 1))
    else:
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    assert main(["run", str(art), "--text", "the one"]) == 2
    assert message in _error_line(capsys)


def test_process_level_errors_have_no_traceback(tmp_path):
    for argv in (["compile", str(tmp_path / "nope"), "-o", str(tmp_path / "out")],
                 ["inspect", str(tmp_path), "--budget", "2"]):
        proc = subprocess.run([sys.executable, "-m", "rbcompile", *argv], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    _no_artifact(tmp_path)
