"""Linears stored packed (artifact/packed_weights.py, `compile --weights`): the artifact holds
int4 / int8 blocks listed with their sha256, loads them as the values the full path runs, keeps
them when saved again, and refuses a flipped byte."""
import json

import pytest
import torch
from safetensors import safe_open

import rbcompile
from rbcompile.artifact.packed_weights import linear_keys, pack
from rbcompile.errors import UserError
from rbcompile.frontend.cli import main
from rbcompile.kernels.int_weights import LEVELS, dequantize, quantize


@pytest.fixture(scope="module")
def packed(compiled_tiny, tmp_path_factory):
    compiled, _ = compiled_tiny["llama"]
    folder = tmp_path_factory.mktemp("packed")
    fp32 = rbcompile.load(compiled.save(folder / "fp32"))   # (the shared model stays fp32)
    return fp32, fp32.save(folder / "int4", weights="int4"), folder


def _weights(model) -> dict[str, torch.Tensor]:
    from rbcompile.artifact.module import stored_weights
    return stored_weights([model.module, model.decoder.module])


def test_int4_artifact_stores_blocks_and_loads_their_values(packed):
    fp32, folder, _ = packed
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["packed_weights"]
    assert entry["level"] == "int4" and entry["file"] == "weights-int4.safetensors"
    assert entry["file"] in manifest["files"]["sha256"] and entry["max_abs_error"] > 0
    original, model = _weights(fp32), rbcompile.load(folder)
    loaded = _weights(model)
    keys = linear_keys(original)
    with safe_open(str(folder / "weights.safetensors"), "pt") as handle:
        assert not set(keys) & set(handle.keys())      # the fp32 file keeps the rest only
    for key in keys:
        level = "int8" if key == "lm_head.weight" else "int4"
        assert torch.equal(loaded[key], dequantize(quantize(original[key], LEVELS[level])))
    assert max((loaded[key] - original[key]).abs().max() for key in keys) == pytest.approx(
        entry["max_abs_error"])
    assert model.weights_level == "int4"
    ids = torch.tensor([[5, 17, 9, 33]])
    assert len(model.generate(ids, torch.ones_like(ids), max_new_tokens=4).tokens[0]) == 4


def test_saving_a_packed_artifact_again_keeps_its_blocks(packed, monkeypatch):
    import rbcompile.kernels.int_weights as int_weights

    _, folder, root = packed
    model = rbcompile.load(folder)
    monkeypatch.setattr(int_weights, "quantize", lambda *a, **k: pytest.fail("re-quantized"))
    again = model.save(root / "again")
    monkeypatch.undo()
    with safe_open(str(folder / "weights-int4.safetensors"), "pt") as first, \
            safe_open(str(again / "weights-int4.safetensors"), "pt") as second:
        assert first.keys() == second.keys()
        assert all(torch.equal(first.get_tensor(k), second.get_tensor(k)) for k in first.keys())
    unpacked = rbcompile.load(folder).save(root / "unpacked", weights="fp32")
    assert not (unpacked / "weights-int4.safetensors").exists()
    assert "packed_weights" not in json.loads((unpacked / "manifest.json").read_text())


def test_a_flipped_byte_in_the_packed_file_is_refused(packed, tmp_path, capsys):
    import shutil

    _, folder, _ = packed
    copy = tmp_path / "flipped"
    shutil.copytree(folder, copy)
    path = copy / "weights-int4.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="weights-int4.safetensors: sha256 does not match"):
        rbcompile.load(copy)
    assert main(["verify", str(copy)]) == 2
    assert "sha256 does not match" in capsys.readouterr().err


def test_the_manifest_and_the_layout_are_checked(packed, tmp_path):
    import shutil

    from safetensors.torch import save_file

    _, folder, _ = packed
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["schema_version"] == 3     # a reader that cannot unpack refuses it
    for change, message in (({"schema_version": 2}, "come with schema version 3"),
                            ({"packed_weights": {**manifest["packed_weights"],
                                                 "file": "weights.safetensors"}},
                             "packed_weights must be")):
        copy = tmp_path / message.split()[0]
        shutil.copytree(folder, copy)
        (copy / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(UserError, match=message):
            rbcompile.load(copy)
    from rbcompile.artifact.packed_weights import unpack
    save_file({"a.data": torch.zeros(2, dtype=torch.uint8)}, str(tmp_path / "bad.safetensors"),
              metadata={"rbcompile_packing": json.dumps({"a": [4, 32, 2, 32]})})
    with pytest.raises(UserError, match="corrupt packed weights .*KeyError"):
        unpack(tmp_path / "bad.safetensors")


def test_pack_refuses_an_unknown_level():
    with pytest.raises(UserError, match="--weights must be fp32 or one of int8, int4"):
        pack({"a_proj.weight": torch.zeros(4, 32)}, "int2")


def test_weights_changed_by_packing_leave_their_calibration_unmeasured():
    from rbcompile.artifact.packed_weights import unmeasure

    manifest = {"precisions": [{"level": "int4"}],
                "plans": [{"budget": 0, "quality_loss": 0.0, "decoder_quality_loss": 0.0},
                          {"budget": 0.1, "quality_loss": 0.02, "decoder_quality_loss": 0.03,
                           "precision_losses": {"int4": 0.05}}]}
    kept = manifest["plans"][1]
    unmeasure(manifest)
    assert "precisions" not in manifest and kept["quality_loss"] == 0.02   # a copy changed
    assert [(p["quality_loss"], p["decoder_quality_loss"]) for p in manifest["plans"]] == [
        (0.0, 0.0), (None, None)]
    assert "precision_losses" not in manifest["plans"][1]   # the pairs went with the levels
