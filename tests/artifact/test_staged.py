"""Region-by-region execution equals the generated forward; regrouping equals running the
smaller batch from the start."""
import pytest
import torch

from rbcompile.artifact.staged import StagedRunner

from conftest import ARCHS, random_batch


def _setting(compiled, seed):
    generator = torch.Generator().manual_seed(seed)
    gates = (torch.rand(compiled.num_gates, generator=generator) > 0.3).tolist()
    widths = (0.4 + 0.6 * torch.rand(compiled.num_gates, generator=generator)).tolist()
    return gates, widths


@pytest.mark.parametrize("arch", ARCHS)
def test_run_equals_forward_under_gates_and_widths(calibrated_tiny, arch):
    compiled = calibrated_tiny[arch]
    runner = StagedRunner(compiled)
    ids, mask = random_batch(3, 11)
    for seed in range(4):
        gates, widths = _setting(compiled, seed)
        expected = compiled(ids, mask, gates=gates, widths=widths)
        got = runner.run(ids, mask, gates, widths)
        for name in compiled.output_names:
            assert torch.equal(got[name], expected[name]), (arch, seed, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_run_equals_forward_at_the_width_boundaries(calibrated_tiny, arch):
    """Every gate at the same width: exactly at a level, between two, below the lowest, above
    the widest, none; and all gates off. A request runs at the narrowest level >= it."""
    compiled = calibrated_tiny[arch]
    runner = StagedRunner(compiled)
    ids, mask = random_batch(3, 11)
    widest, lowest = max(compiled.module.WIDTH_LEVELS), min(compiled.module.WIDTH_LEVELS)
    requests = {"none": None, "above": (1 + widest) / 2, "widest": widest,
                "between": (widest + lowest) / 2, "lowest": lowest, "below": lowest / 2}
    outputs = {}
    for gates_on in (True, False):
        gates = [gates_on] * compiled.num_gates
        for label, width in requests.items():
            widths = None if width is None else [width] * compiled.num_gates
            expected = compiled(ids, mask, gates=gates, widths=widths)
            got = runner.run(ids, mask, gates, widths)
            for name in compiled.output_names:
                assert torch.equal(got[name], expected[name]), (arch, gates_on, label, name)
            outputs[gates_on, label] = got[compiled.output_names[0]]
    same = [("none", "above"), ("between", "widest"), ("lowest", "below")]
    for a, b in same:
        assert torch.equal(outputs[True, a], outputs[True, b]), (arch, a, b)
    assert not torch.equal(outputs[True, "none"], outputs[True, "widest"])
    assert not torch.equal(outputs[True, "widest"], outputs[True, "lowest"])
    assert all(torch.equal(outputs[False, label], outputs[False, "none"]) for label in requests)


@pytest.mark.parametrize("arch", ARCHS)
def test_regrouped_rows_continue_as_a_smaller_batch(calibrated_tiny, arch):
    compiled = calibrated_tiny[arch]
    runner = StagedRunner(compiled)
    ids, mask = random_batch(5, 9)
    gates, widths = _setting(compiled, 7)
    stage = runner.advance(runner.start(ids, mask), gates, widths, until_layer=1)
    rows = torch.tensor([4, 1])
    rest = runner.advance(runner.select(stage, rows=rows), gates, widths)
    expected = compiled(ids[rows], mask[rows], gates=gates, widths=widths)
    assert rest.rows.tolist() == [4, 1]
    for name in compiled.output_names:
        torch.testing.assert_close(runner.result(rest)[name], expected[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_last_positions_run_the_tail_on_a_slice(calibrated_tiny, arch):
    """The logit lens: the stream after layer 1 through the final norm and head, last 3 tokens."""
    compiled = calibrated_tiny[arch]
    runner = StagedRunner(compiled)
    ids, mask = random_batch(2, 8, pad_row=False)
    stage = runner.advance(runner.start(ids, mask), [True] * compiled.num_gates, until_layer=1)
    later_off = [r["layer"] <= 1 for r in sorted((r for r in compiled.regions
                                                  if r["kind"] == "prunable"),
                                                 key=lambda r: r["gate"])]
    lens = runner.advance(runner.select(stage, last_positions=3), later_off)
    expected = compiled(ids, mask, gates=later_off)["logits"][:, -3:]
    torch.testing.assert_close(runner.result(lens)["logits"], expected, rtol=0, atol=1e-5)
