"""Elastic width: narrowed regions equal the model without the dropped heads / channels."""
import pytest
import torch

import rbcompile

from conftest import eager_outputs, make_tiny_model, max_diff, random_batch


def _module(model, path):
    return model.get_submodule(path)


def _keep_only(indices, size_per_index, total):
    keep = torch.zeros(total, dtype=torch.bool)
    for i in indices:
        keep[i * size_per_index:(i + 1) * size_per_index] = True
    return keep


def _zero_input_hook(keep):
    def hook(module, args):
        return (args[0] * keep.to(args[0].dtype),) + args[1:]
    return hook


@pytest.mark.parametrize("arch,expected", [("llama", {"attention", "mlp"}), ("gpt2", {"mlp"}),
                                           ("bert", {"layer"})])
def test_width_levels_exist_where_prefixes_are_views(calibrated_tiny, arch, expected):
    compiled = calibrated_tiny[arch]
    by_id = {r["id"]: r for r in compiled.regions}
    variants = compiled.ir["variants"]
    assert [v["ratio"] for v in variants] == [0.75, 0.5]
    assert {by_id[int(i)]["unit_kind"] for v in variants for i in v["regions"]} == expected
    module = compiled.module
    for name, (key, axis, length) in module.PARAMETER_VIEWS.items():
        base = module.get_buffer(next(n for n, k in module.PARAMETERS.items() if k == key))
        view = module.get_buffer(name)
        assert view.data_ptr() == base.data_ptr() and view.shape[axis] == length


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_narrowed_region_equals_model_without_dropped_units(calibrated_tiny, kind):
    compiled = calibrated_tiny["llama"]
    region = next(r for r in compiled.regions if r.get("unit_kind") == kind and r["layer"] == 1)
    permutation = compiled.manifest["calibration"]["permutations"][region["name"]]
    eager = make_tiny_model("llama")  # original order: drop by the recorded permutation
    if kind == "attention":
        kept = permutation["q"][:2]  # 0.5 of 2 KV groups = 1 group = 2 query heads
        keep = _keep_only(kept, 8, 32)
        target = "model.layers.1.self_attn.o_proj"
    else:
        kept = permutation["channels"][:24]
        keep = _keep_only(kept, 1, 48)
        target = "model.layers.1.mlp.down_proj"
    eager.get_submodule(target).register_forward_pre_hook(_zero_input_hook(keep))
    widths = [1.0] * compiled.num_gates
    widths[region["gate"]] = 0.5
    ids, mask = random_batch(3, 14)
    out = compiled(ids, mask, widths=widths)
    assert out.skipped_flops > 0
    assert max_diff(out, eager_outputs(eager, ids, mask)) <= 1e-5


def test_floor_clamps_narrower_requests(calibrated_tiny):
    compiled = calibrated_tiny["llama"]
    ids, mask = random_batch(2, 9)
    floor = compiled(ids, mask, widths=[0.5] * compiled.num_gates)
    below = compiled(ids, mask, widths=[0.1] * compiled.num_gates)
    assert torch.equal(floor["logits"], below["logits"])
    assert floor.skipped_flops == below.skipped_flops > 0
    for plan in compiled.plans:
        assert all(w >= 0.5 for w in dict(plan.widths).values())
        assert plan.skipped_share <= plan.budget + 1e-9


def test_bad_widths_are_rejected(calibrated_tiny):
    compiled = calibrated_tiny["llama"]
    with pytest.raises(ValueError, match="widths must be"):
        compiled(*random_batch(1, 4), widths=[0.0] * compiled.num_gates)


def test_width_artifact_round_trip(calibrated_tiny, tmp_path):
    compiled = calibrated_tiny["bert"]
    loaded = rbcompile.load(compiled.save(tmp_path / "bert"))
    ids, mask = random_batch(2, 11)
    widths = [0.75] * compiled.num_gates
    a = compiled(ids, mask, widths=widths)
    b = loaded(ids, mask, widths=widths)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max_diff(loaded(ids, mask), eager_outputs(make_tiny_model("bert"), ids, mask)) <= 1e-5


def test_cli_rejects_levels_below_the_floor(tiny_checkpoints, calib_file, tmp_path, capsys):
    from rbcompile.frontend.cli import main
    assert main(["compile", str(tiny_checkpoints["gpt2"]), "-o", str(tmp_path / "o"), "--calib",
                 str(calib_file), "--width-levels", "0.75,0.25"]) == 2
    assert "width levels must be in [0.5, 1)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_inspect_shows_narrowed_regions(calibrated_tiny, tmp_path, capsys):
    from rbcompile.frontend.cli import main
    compiled = calibrated_tiny["llama"]
    art = compiled.save(tmp_path / "llama")
    plan = next(p for p in compiled.plans if p.widths)
    assert main(["inspect", str(art), "--budget", str(plan.budget)]) == 0
    out = capsys.readouterr().out
    assert "calibrated plans" in out and "width 0." in out
    assert f"narrows {len(plan.widths)} = {plan.skipped_share:.1%}" in out
