"""Skipping a prunable region equals the original model with that block replaced by identity."""
import copy

import pytest

from conftest import ARCHS, eager_outputs, max_diff, random_batch
from shared import identity_layer_hook, reference_without


@pytest.mark.parametrize("arch", ARCHS)
def test_skipping_each_region_equals_identity_reference(compiled_tiny, arch):
    compiled, eager = compiled_tiny[arch]
    input_ids, attention_mask = random_batch(2, 13)
    prunable = [r for r in compiled.regions if r["kind"] == "prunable"]
    for region in prunable:
        gates = [True] * compiled.num_gates
        gates[region["gate"]] = False
        out = compiled(input_ids, attention_mask, gates=gates)
        expected = eager_outputs(reference_without(eager, region), input_ids, attention_mask)
        assert max_diff(out, expected) <= 1e-5, region["name"]
        assert max_diff(out, eager_outputs(eager, input_ids, attention_mask)) > 1e-4


def test_skipping_a_whole_decoder_layer(compiled_tiny):
    compiled, eager = compiled_tiny["llama"]
    gates = [True] * compiled.num_gates
    for region in compiled.regions:
        if region["kind"] == "prunable" and region["layer"] == 2:
            gates[region["gate"]] = False
    reference = copy.deepcopy(eager)
    reference.model.layers[2].register_forward_hook(identity_layer_hook, with_kwargs=True)
    input_ids, attention_mask = random_batch(3, 10)
    assert max_diff(compiled(input_ids, attention_mask, gates=gates),
                    eager_outputs(reference, input_ids, attention_mask)) <= 1e-5


def test_budget_plan_skips_regions_and_reports_it(compiled_tiny):
    compiled, _ = compiled_tiny["gpt2"]
    input_ids, attention_mask = random_batch(2, 8)
    out = compiled(input_ids, attention_mask, budget=0.3)
    assert out.path == "light"
    assert 0 < out.skipped_flops <= 0.3
    assert out.gates == compiled.gates_for_budget(0.3) and not all(out.gates)
