"""The full path equals the original model (fp32 max abs diff <= 1e-5)."""
import pytest
import torch

import rbcompile

from conftest import ARCHS, eager_outputs, max_diff, random_batch

TOL = 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(3, 17), (1, 5), (4, 64)])
def test_full_path_matches_eager(compiled_tiny, arch, shape):
    compiled, eager = compiled_tiny[arch]
    input_ids, attention_mask = random_batch(*shape)
    out = compiled(input_ids, attention_mask)
    assert out.path == "full" and all(out.gates)
    assert max_diff(out, eager_outputs(eager, input_ids, attention_mask)) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_then_loaded_artifact_is_identical(compiled_tiny, arch, tmp_path):
    compiled, _ = compiled_tiny[arch]
    loaded = rbcompile.load(compiled.save(tmp_path / arch))
    assert loaded.source == compiled.source
    input_ids, attention_mask = random_batch(2, 9)
    for gates in ([True] * compiled.num_gates, compiled.gates_for_budget(0.5)):
        a = compiled(input_ids, attention_mask, gates=gates)
        b = loaded(input_ids, attention_mask, gates=gates)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_shape_cache_serves_repeated_shapes(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    cache = compiled.module.region_cache
    cache.clear()
    hits = cache.hits
    input_ids, attention_mask = random_batch(2, 11, seed=5)
    first = compiled(input_ids, attention_mask)
    other_ids, _ = random_batch(2, 11, seed=6)  # same shape and mask, other tokens
    compiled(other_ids, attention_mask)
    assert cache.hits == hits + 1 and len(cache) == 1
    again = compiled(input_ids, attention_mask)
    assert torch.equal(first["logits"], again["logits"])
    padded = attention_mask.clone()
    padded[0, :2] = 0  # a different mask is a different key
    compiled(input_ids, padded)
    assert len(cache) == 2
