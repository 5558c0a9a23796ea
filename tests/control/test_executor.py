"""Tiered execution: each tier's rows equal their own smaller batch run with the tier's plan."""
import pytest
import torch

from rbcompile.runtime.control.complexity import ComplexityEstimator, Tiers
from rbcompile.runtime.control.executor import TieredExecutor
from rbcompile.runtime.control.policy import Decision

from conftest import random_batch


def _expected(executor, ids, mask, row, tier, decision):
    """The row alone through the generated forward with the tier's plan (probe layers full)."""
    compiled = executor.compiled
    gates, widths = executor.setting(tier, decision)
    probe = executor.estimator.probe_layer
    if probe is not None:
        layer = {r["gate"]: r["layer"] for r in compiled.regions if r["kind"] == "prunable"}
        gates = [g or layer[i] <= probe for i, g in enumerate(gates)]
        widths = widths and [1.0 if layer[i] <= probe else w for i, w in enumerate(widths)]
    out = compiled(ids[row:row + 1], mask[row:row + 1], gates=gates, widths=widths)
    return executor._summarise(out, ids[row:row + 1], mask[row:row + 1], 0)


def _two_rows_per_tier(compiled):
    """An executor whose tier thresholds put two rows of a 6-row batch in each tier."""
    ids, mask = random_batch(6, 10, pad_row=False)
    executor = TieredExecutor(compiled)
    scores = sorted(r.score for r in executor.run(ids, mask, Decision()))
    executor.tiers = Tiers(light_below=scores[2], full_from=scores[4])
    return executor, ids, mask, scores


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_decoder_tiers_regroup_rows_and_match_their_plans(calibrated_tiny, arch):
    compiled = calibrated_tiny[arch]
    ids, mask = random_batch(6, 10, pad_row=False)
    estimator = ComplexityEstimator(compiled)
    assert estimator.probe_layer == 0
    executor = TieredExecutor(compiled, estimator=estimator)
    cheap = estimator.score(ids, mask)
    assert cheap.shape == (6,) and bool(((cheap >= 0) & (cheap <= 1)).all())
    probe = executor.run(ids, mask, Decision(budget=0.0))
    scores = sorted(r.score for r in probe)
    executor.tiers = Tiers(light_below=scores[2], full_from=scores[4])
    decision = Decision(budget=0.3)
    results = executor.run(ids, mask, decision)
    assert sorted(r.tier for r in results) == [0, 0, 1, 1, 2, 2]
    for row, result in enumerate(results):
        expected = _expected(executor, ids, mask, row, result.tier, decision)
        for name, value in expected.items():
            torch.testing.assert_close(result.outputs[name], value, rtol=0, atol=1e-5)
    assert results[[r.tier for r in results].index(2)].skipped == 0.0
    assert max(r.skipped for r in results) > 0


def test_encoder_rows_exit_early_or_match_the_full_path(task_bert):
    ids, mask = random_batch(8, 12, seed=5)
    never = TieredExecutor(task_bert, exit_threshold=1.01).run(ids, mask, Decision(budget=0.0))
    for row, result in enumerate(never):
        assert result.exit_layer == -1 and result.skipped == 0.0
        expected = _expected(TieredExecutor(task_bert), ids, mask, row, result.tier, Decision())
        torch.testing.assert_close(result.outputs["logits"], expected["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(result.outputs["embedding"], expected["embedding"],
                                   rtol=0, atol=1e-5)
    executor = TieredExecutor(task_bert, tiers=Tiers(light_below=1.0, full_from=1.0),
                              exit_threshold=0.0)
    exits = executor.run(ids, mask, Decision(budget=0.0))
    assert all(r.exit_layer == task_bert.offramps.layers[0] for r in exits)
    assert all(r.skipped > 0.4 for r in exits)  # layers after the first ramp never ran
    assert all(0.5 <= r.confidence <= 1 for r in exits)


def test_tier_shift_moves_rows_to_lighter_tiers(calibrated_tiny):
    compiled = calibrated_tiny["llama"]
    executor, ids, mask, scores = _two_rows_per_tier(compiled)
    assert executor.tiers.shifted(0.0) is executor.tiers
    half = executor.tiers.shifted(0.5)
    assert half.light_below == pytest.approx((1 + scores[2]) / 2)
    assert half.full_from == pytest.approx((1 + scores[4]) / 2)
    assert executor.tiers.shifted(1.0).constant() == 0
    shifted = executor.run(ids, mask, Decision(budget=0.3, tier_shift=1.0))
    assert all(r.tier == 0 for r in shifted)
    gates, widths = executor.setting(0, Decision(budget=0.3))  # no probe: the plan throughout
    out = compiled(ids, mask, gates=gates, widths=widths)
    for row, result in enumerate(shifted):
        expected = executor._summarise(out, ids, mask, row)
        torch.testing.assert_close(result.outputs["token_logprobs"], expected["token_logprobs"],
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("steps", (1, 2))
def test_unconfident_rows_escalate_from_the_probe_and_match_the_higher_tier(calibrated_tiny, steps):
    compiled = calibrated_tiny["llama"]
    executor, ids, mask, scores = _two_rows_per_tier(compiled)
    first = executor.run(ids, mask, Decision(budget=0.3))
    assert sorted(r.tier for r in first) == [0, 0, 1, 1, 2, 2]
    escalated = executor.run(ids, mask, Decision(budget=0.3), confidence_threshold=1.01,
                             max_fallback_steps=steps)   # nothing is confident enough
    for row, (before, after) in enumerate(zip(first, escalated)):
        assert after.tier == min(2, before.tier + steps)
        assert after.fallback_steps == after.tier - before.tier
        expected = _expected(executor, ids, mask, row, after.tier, Decision(budget=0.3))
        torch.testing.assert_close(after.outputs["token_logprobs"], expected["token_logprobs"],
                                   rtol=0, atol=1e-5)


def test_no_escalation_into_a_tier_that_would_compute_the_same_answer(calibrated_tiny, task_bert):
    compiled = calibrated_tiny["llama"]
    executor, ids, mask, scores = _two_rows_per_tier(compiled)
    plain = executor.run(ids, mask, Decision(budget=0.0))   # every tier runs the full path
    retried = executor.run(ids, mask, Decision(budget=0.0), confidence_threshold=1.01,
                           max_fallback_steps=2)
    assert [r.tier for r in retried] == [r.tier for r in plain]
    assert all(r.fallback_steps == 0 for r in retried)
    # encoder at budget 0: a row that ran to the end already has the full answer; one that
    # exited early goes straight to the full tier (the medium tier would exit the same way)
    bert_ids, bert_mask = random_batch(8, 12, seed=5)
    exiting = TieredExecutor(task_bert, tiers=Tiers(light_below=1.0, full_from=1.0),
                             exit_threshold=0.0)
    assert exiting._escalation_targets({t: exiting.setting(t, Decision()) for t in (0, 1, 2)}) == {
        (0, False): None, (0, True): 2, (1, False): None, (1, True): 2,
        (2, False): None, (2, True): None}
    exiting.tiers = Tiers()
    for result in exiting.run(bert_ids, bert_mask, Decision(), confidence_threshold=1.01,
                              max_fallback_steps=2):
        assert result.exit_layer == -1 and result.fallback_steps <= 1
