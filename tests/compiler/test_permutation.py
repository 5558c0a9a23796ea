"""The width permutation pass: exact (full path unchanged) and importance-ordered."""
import pytest
import torch

import rbcompile
from rbcompile.passes.permute_width import head_orders

from conftest import ARCHS, eager_outputs, make_tiny_model, max_diff, random_batch


@pytest.fixture(scope="module")
def calib_text(calib_file):
    return calib_file


def _compile(model, tokenizer_dir, calib_text, tmp_path):
    model.save_pretrained(tmp_path)
    from conftest import save_tiny_tokenizer
    save_tiny_tokenizer(tmp_path)
    return rbcompile.compile(tmp_path, calib=calib_text, calib_samples=8, calib_seq=32)


@pytest.mark.parametrize("arch", ARCHS)
def test_permutation_is_exact_and_moves_weights(arch, calib_text, tmp_path):
    eager = make_tiny_model(arch)
    compiled = _compile(make_tiny_model(arch), None, calib_text, tmp_path)
    permutations = compiled.manifest["calibration"]["permutations"]
    assert permutations and any(order != sorted(order) for unit in permutations.values()
                                for order in unit.values())
    for shape in ((3, 17), (1, 6)):
        ids, mask = random_batch(*shape)
        assert max_diff(compiled(ids, mask), eager_outputs(eager, ids, mask)) <= 1e-5
    # the stored weights really are reordered: first layer's permuted parameter differs
    original = dict(eager.named_parameters())
    changed = [key for key in compiled.module.PARAMETERS.values()
               if key in original and not torch.equal(original[key], compiled.module.get_buffer(
                   next(n for n, k in compiled.module.PARAMETERS.items() if k == key)))]
    assert changed


def test_gqa_groups_move_with_their_query_heads():
    q_order, kv_order = head_orders([0.1, 0.2, 0.9, 0.8, 0.3, 0.05], kv_heads=3)
    assert kv_order == [1, 2, 0]
    assert q_order == [2, 3, 4, 5, 1, 0]
    assert [q // 2 for q in q_order] == [kv for kv in kv_order for _ in range(2)]


def test_head_with_zeroed_output_projection_ranks_last(calib_text, tmp_path):
    model = make_tiny_model("gpt2")
    with torch.no_grad():  # Conv1D weight is [in, out]: head 2's rows of c_proj feed nothing
        model.transformer.h[1].attn.c_proj.weight[16:24] = 0
    compiled = _compile(model, None, calib_text, tmp_path)
    calibration = compiled.manifest["calibration"]
    scores = calibration["width"]["transformer.h.1.attn"]["heads"]
    assert scores[2] == 0 and min(scores) == 0 and sorted(scores)[1] > 0
    assert calibration["permutations"]["transformer.h.1.attn"]["q"][-1] == 2


def test_minilm_permutation_is_exact(minilm):
    _, eager, tokenizer = minilm
    compiled = rbcompile.compile("minilm-l6", calib="default", calib_samples=24, calib_seq=48,
                                 calib_budgets=[0.25])   # the permutation, not the plan search
    assert compiled.manifest["calibration"]["permutations"]
    batch = tokenizer(["A gripping, beautifully acted film.", "Dull and long."],
                      return_tensors="pt", padding=True)
    out = compiled(batch["input_ids"], batch["attention_mask"])
    assert max_diff(out, eager_outputs(eager, batch["input_ids"], batch["attention_mask"])) <= 1e-5
