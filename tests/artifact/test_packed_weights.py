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


def test_saving_a_packed_artifact_again_keeps_its_blocks(packed):
    _, folder, root = packed
    again = rbcompile.load(folder).save(root / "again")
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


def test_pack_refuses_an_unknown_level():
    with pytest.raises(UserError, match="--weights must be fp32 or one of int8, int4"):
        pack({"a_proj.weight": torch.zeros(4, 32)}, "int2")
