"""Loading an artifact runs only code generated from an allow-listed graph description."""
import hashlib
import json
import shutil

import pytest

import rbcompile
from rbcompile.errors import UserError


@pytest.fixture(scope="module")
def artifact(compiled_tiny, tmp_path_factory):
    compiled, _ = compiled_tiny["gpt2"]
    return compiled.save(tmp_path_factory.mktemp("artifact") / "gpt2")


def _tamper(artifact, tmp_path, edit):
    """Copy the artifact, edit graph.json and re-sign it in the manifest (a deliberate attack)."""
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    ir = json.loads((art / "graph.json").read_text())
    edit(ir)
    data = json.dumps(ir).encode()
    (art / "graph.json").write_bytes(data)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["sha256"]["graph.json"] = hashlib.sha256(data).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def _set_op(ir, op):
    ir["nodes"][3][1] = op


@pytest.mark.parametrize("edit,message", [
    (lambda ir: _set_op(ir, "builtins.eval"), "bad operation name"),
    (lambda ir: _set_op(ir, "aten.not_an_op.default"), "unknown operation"),
    (lambda ir: ir["nodes"][3].__setitem__(0, "x; import os"), "bad name"),
    (lambda ir: ir["regions"][0].__setitem__("name", "a\nimport os"), "bad text"),
    (lambda ir: ir.__setitem__("title", 'x"""\nimport os\n"""'), "bad text"),
    (lambda ir: ir["parameters"].__setitem__("p", "a'b"), "bad parameter key"),
    (lambda ir: ir["nodes"][3][2].append({"code": "1"}), "bad argument"),
    (lambda ir: ir.__setitem__("version", 99), "version"),
])
def test_tampered_graph_is_refused(artifact, tmp_path, edit, message):
    with pytest.raises(UserError, match=message):
        rbcompile.load(_tamper(artifact, tmp_path, edit))


def test_graph_edit_that_regenerates_other_code_is_refused(artifact, tmp_path):
    """A valid but different graph does not match the model.py the manifest vouches for."""
    def swap_op(ir):
        node = next(n for n in ir["nodes"] if n[1] == "aten.add.Tensor")
        node[1] = "aten.sub.Tensor"
    with pytest.raises(UserError, match="does not match the code regenerated"):
        rbcompile.load(_tamper(artifact, tmp_path, swap_op))


def test_newer_schema_is_refused(artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["schema_version"] = 4
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"unsupported schema version 4 \(this rbcompile reads 2 "
                                        r"and 3\)"):
        rbcompile.load(art)


def test_saving_over_an_artifact_replaces_it_and_refuses_other_folders(compiled_tiny, tmp_path):
    compiled, _ = compiled_tiny["bert"]
    target = compiled.save(tmp_path / "a")
    compiled.save(target)  # replacing an artifact is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an rbcompile artifact"):
        compiled.save(other)
    assert (other / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "precious"]


def test_tied_weights_are_stored_once(tmp_path):
    """torch.export reads a tied embedding/head through one attribute: one tensor on disk."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_config
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval()
    compiled = rbcompile.compile(model)
    art = compiled.save(tmp_path / "tied")
    from safetensors import safe_open
    with safe_open(str(art / "weights.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len(keys & {"lm_head.weight", "model.embed_tokens.weight"}) == 1
    loaded = rbcompile.load(art)
    import torch
    ids = torch.randint(3, 90, (2, 6))
    assert torch.equal(loaded(ids)["logits"], compiled(ids)["logits"])


def test_loading_an_artifact_imports_no_compiler(artifact):
    """Layering: loading an artifact (as the run side's Model, which generates) imports no
    pass, compiler, fused kernel (this artifact is unfused), transformers model class, nor
    the run side's control or serving; the in-process server adds only the run side."""
    import subprocess
    import sys
    compiler = ("'rbcompile.passes', 'rbcompile.compiler', 'rbcompile.frontend', "
                "'rbcompile.kernels', 'triton', 'transformers.models'")
    code = ("import sys, rbcompile; rbcompile.load(sys.argv[1]);"
            f"print(sorted(m for m in sys.modules if m.startswith(({compiler}, "
            "'rbcompile.runtime.control', 'rbcompile.runtime.serving'))));"
            "import rbcompile.runtime.control.server;"
            f"print(sorted(m for m in sys.modules if m.startswith(({compiler}))))")
    result = subprocess.run([sys.executable, "-c", code, str(artifact)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "[]"]
