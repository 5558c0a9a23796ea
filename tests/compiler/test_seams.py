"""Seams (passes/mark_seams.py, regions.run_regions): the residual add that ends one region,
fused into the next region's first norm when both regions run at full width."""
import copy
import itertools

import pytest
import torch

import rbcompile
from rbcompile.artifact.codegen import generate_source
from rbcompile.artifact.ir import check_ir
from rbcompile.errors import UserError

from conftest import eager_outputs, max_diff, random_batch


def _seams(ir: dict) -> list[dict]:
    return [region for region in ir["regions"] if "seam" in region]


# 4 pre-LN layers: attention -> MLP -> next attention ... -> final norm, 8 guards; BERT is
# post-LN: its adds and norms share a region (fuse_kernels' add_layer_norm)
@pytest.mark.parametrize("arch, expected", [("llama", 8), ("gpt2", 8), ("bert", 0)])
def test_pass_marks_a_seam_at_every_pre_ln_guard(fused_tiny, arch, expected):
    compiled, _ = fused_tiny[arch]
    (entry,) = [p for p in compiled.manifest["passes"] if p["pass"] == "mark_seams"]
    assert entry["stats"]["seams"] == expected
    nodes = {node[0]: node for node in compiled.ir["nodes"]}
    for region in _seams(compiled.ir):
        seam = region["seam"]
        assert nodes[seam["add"]][1:3] == ["aten.add.Tensor", [{"node": seam["residual"]},
                                                               {"node": seam["branch"]}]]
        assert nodes[seam["norm"]][4] == region["id"] + 1
        assert nodes[seam["norm"]][1] in ("rbcompile.rms_norm.default",
                                          "rbcompile.layer_norm.default")


def test_no_seams_without_kernels(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    assert not _seams(compiled.ir)
    assert "_add_norm" not in compiled.source


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_gate_set_equals_the_regions_run_apart(fused_tiny, arch):
    compiled, eager = fused_tiny[arch]
    ids, mask = random_batch(2, 9)
    module = compiled.module
    assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
    for gates in itertools.product([True, False], repeat=module.NUM_GATES):
        with torch.no_grad():
            fused_out = module(ids, mask, list(gates))
            module.fuse_seams = False
            apart = module(ids, mask, list(gates))
            module.fuse_seams = True
        assert all(torch.equal(a, b) for a, b in zip(fused_out, apart)), gates


def _called(module, gates) -> list[str]:
    """The region methods `module` calls under `gates`, in order."""
    called, names = [], [name for region in module.REGIONS for name in region.methods]
    for name in names:
        method = getattr(module, name)

        def record(*args, _method=method, _name=name):
            called.append(_name)
            return _method(*args)
        module.__dict__[name] = record
    try:
        with torch.no_grad():
            module(*random_batch(2, 9), gates)
    finally:
        for name in names:
            del module.__dict__[name]
    return called


def test_seam_methods_run_only_when_both_sides_run(fused_tiny):
    compiled, _ = fused_tiny["llama"]
    module = compiled.module
    prunable = [r for r in module.REGIONS if r.kind == "prunable"]  # regions 3..10, gates 0..7
    head = module.REGIONS[-1]

    called = _called(module, [True] * 8)
    assert [name for name in called if name.startswith(("r3_", "r4_", "r11_"))] == [
        prunable[0].method + "_unadded", prunable[1].method + "_add_norm_unadded",
        head.method + "_add_norm"]
    assert not set(called) & {region.method for region in prunable}

    gates = [True] * 8
    gates[1] = False  # layer 0's MLP off: attention 0 adds its own residual, layer 1 opens again
    called = _called(module, gates)
    assert prunable[0].method in called and not any(n.startswith("r4_") for n in called)
    assert prunable[2].method + "_unadded" in called

    module.fuse_seams = False
    try:
        assert _called(module, [True] * 8)[-1] == head.method
    finally:
        module.fuse_seams = True


def test_artifact_round_trip_keeps_the_seams(fused_tiny, tmp_path):
    compiled, _ = fused_tiny["gpt2"]
    loaded = rbcompile.load(compiled.save(tmp_path / "seams"))
    assert "rbcompile_ops.add_layer_norm.default" in loaded.source
    ids, mask = random_batch(2, 9)
    assert torch.equal(loaded(ids, mask)["logits"], compiled(ids, mask)["logits"])


@pytest.mark.parametrize("tamper", ["norm", "add", "reader"])
def test_tampered_seam_is_refused(fused_tiny, tamper):
    compiled, _ = fused_tiny["llama"]
    ir = copy.deepcopy(compiled.ir)
    region = _seams(ir)[0]
    if tamper == "norm":  # a node that is not the norm reading the sum
        region["seam"]["norm"] = region["seam"]["branch"]
    elif tamper == "add":
        region["seam"]["residual"], region["seam"]["branch"] = (region["seam"]["branch"],
                                                                region["seam"]["residual"])
    else:  # the sum is also read two regions on
        later = next(n for n in ir["nodes"] if n[4] == region["id"] + 2
                     and n[1] == "aten.linear.default")
        later[2][0] = {"node": region["seam"]["add"]}
    with pytest.raises(UserError, match="bad seam"):
        generate_source(ir)
    check_ir(compiled.ir)


def test_decoder_generates_the_same_tokens_with_seams(tiny_checkpoints):
    compiled = rbcompile.compile(tiny_checkpoints["llama"], kernels=True)
    assert len(_seams(compiled.decoder.ir)) == 8
    prompt = torch.tensor([[1, 5, 9, 14, 22, 31]])
    fused_tokens = compiled.generate(prompt, max_new_tokens=8).tokens
    compiled.decoder.module.fuse_seams = False
    assert compiled.generate(prompt, max_new_tokens=8).tokens == fused_tokens
    assert len(fused_tokens[0]) > 1
