"""Budget plans, complexity routing and the region cache."""
import math

import pytest
import torch

from rbcompile.artifact.input_complexity import LengthRarityComplexity
from rbcompile.artifact.plans import plan_for_budget, skip_order, skipped_share

from conftest import random_batch


def gates_for_budget(regions, budget):
    return plan_for_budget(regions, budget)[0]
from rbcompile.artifact.region_cache import RegionCache


def _regions(layers=6, split=True):
    regions, gate = [], 0
    for layer in range(layers):
        for kind, share in ((("attention", 1), ("mlp", 2)) if split else (("layer", 3),)):
            regions.append({"kind": "prunable", "unit_kind": kind, "layer": layer, "gate": gate,
                            "prunable_share": share / (3 * layers)})
            gate += 1
    return [{"kind": "skeleton"}] + regions


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("budget", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_plan_stays_within_budget_and_keeps_first_and_last_layer(split, budget):
    regions = _regions(split=split)
    gates = gates_for_budget(regions, budget)
    assert skipped_share(regions, gates) <= budget + 1e-9
    for r in regions[1:]:
        if r["layer"] in (0, 5):
            assert gates[r["gate"]]
    if budget == 0:
        assert all(gates)


def test_plans_grow_monotonically_from_the_middle_layers_outward():
    regions = _regions()  # 6 layers: skipping starts at 60% depth (layer 3)
    order = skip_order(regions)
    assert [(r["layer"], r["unit_kind"]) for r in order[:4]] == [
        (3, "attention"), (3, "mlp"), (2, "attention"), (2, "mlp")]
    assert {r["layer"] for r in order} == {1, 2, 3, 4}
    previous = set()
    for budget in (0.05, 0.1, 0.2, 0.3, 0.5):
        off = {i for i, g in enumerate(gates_for_budget(regions, budget)) if not g}
        assert previous <= off
        previous = off


@pytest.mark.parametrize("bad", [-0.1, 1.01, math.nan, math.inf, "x", None])
def test_bad_budget_is_rejected(bad):
    with pytest.raises(ValueError, match="budget"):
        gates_for_budget(_regions(), bad)


def test_complexity_grows_with_length_and_rare_tokens():
    score = LengthRarityComplexity(vocab_size=100, long_input=64)
    common = torch.full((1, 8), 5)
    rare = torch.full((1, 8), 90)
    long_common = torch.full((1, 64), 5)
    ones = torch.ones_like
    values = [score(x, ones(x)).item() for x in (common, rare, long_common)]
    assert values[0] < values[1] and values[0] < values[2]
    assert all(0 <= v <= 1 for v in values)
    padded = torch.ones(1, 64, dtype=torch.long)
    padded[0, 8:] = 0  # padding does not count as length
    assert score(long_common, padded).item() == pytest.approx(values[0])


def test_complexity_threshold_routes_between_light_and_full(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    compiled.complexity_threshold = 0.3
    try:
        easy = torch.full((1, 4), 5)
        hard = torch.full((1, 60), 90)
        out_easy = compiled(easy, budget=0.5)
        out_hard = compiled(hard, budget=0.5)
        assert out_easy.path == "light" and not all(out_easy.gates)
        assert out_hard.path == "full" and all(out_hard.gates)
        assert out_easy.complexity[0] < 0.3 <= out_hard.complexity[0]
    finally:
        compiled.complexity_threshold = None


@pytest.mark.parametrize("make,message", [
    (lambda: (torch.ones(4, dtype=torch.long), None), "2-D"),
    (lambda: (torch.ones(1, 4), None), "integer"),
    (lambda: (torch.ones(1, 0, dtype=torch.long), None), "empty input"),
    (lambda: (torch.ones(1, 65, dtype=torch.long), None), "exceeds the model's 64 positions"),
    (lambda: (torch.full((1, 4), 500), None), "token ids must be in"),
    (lambda: (torch.ones(2, 4, dtype=torch.long), torch.ones(2, 5)), "attention_mask must have"),
])
def test_bad_inputs_raise_clear_errors(compiled_tiny, make, message):
    compiled, _ = compiled_tiny["llama"]
    with pytest.raises(ValueError, match=message):
        compiled(*make())


def test_wrong_number_of_gates(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    with pytest.raises(ValueError, match="expected 8 gates"):
        compiled(*random_batch(1, 4), gates=[True])


def test_region_cache_is_lru_and_bounded():
    cache = RegionCache(max_entries=2)
    calls = []

    def compute(n):
        calls.append(n)
        return torch.zeros(n)

    for n in (1, 2, 1, 3, 2):
        cache.lookup(0, compute, n)
    assert calls == [1, 2, 3, 2] and cache.hits == 1 and len(cache) == 2
    small = RegionCache(max_bytes=16)
    small.lookup(0, compute, 100)  # 400 bytes: computed, not stored
    assert len(small) == 0
