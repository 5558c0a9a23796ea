"""Region-by-region execution equals the generated forward; regrouping equals running the
smaller batch from the start."""
import pytest
import torch

from conftest import ARCHS, random_batch
from rbcompile.runtime.staged import StagedRunner


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
