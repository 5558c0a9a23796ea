"""Sampling filters against transformers' own warpers, the speculative acceptance rule (greedy
exactness, and a statistical test that sampled outputs keep the full model's distribution),
and the n-gram drafter."""
import pytest
import torch

from rbcompile.errors import UserError
from rbcompile.runtime.engine.drafters import NGramDrafter, draft_speedup
from rbcompile.runtime.engine.sampling import SamplingConfig, verify
from rbcompile.runtime.engine.speculation import next_draft_length


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 12, 0.6), (1.0, None, 0.01)])
def test_filters_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                  + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p else []))
    expected = warpers(None, logits.clone()).softmax(-1)
    config = SamplingConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(config.probabilities(logits), expected)


@pytest.mark.parametrize("kwargs,message", [
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=0), "top_k must be >= 1"),
])
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingConfig(**kwargs)


def test_greedy_verify_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for position, token in enumerate([3, 7, 1, 4]):
        logits[position, token] = 5.0
    greedy = SamplingConfig()
    assert verify(greedy, logits, torch.tensor([3, 7, 1])) == (3, 4)   # all kept, then 4
    assert verify(greedy, logits, torch.tensor([3, 2, 1])) == (1, 7)   # rejected at the second
    assert verify(greedy, logits, torch.tensor([9, 7, 1])) == (0, 3)   # rejected at the first
    assert verify(greedy, logits[:1], torch.tensor([], dtype=torch.long)) == (0, 3)


def _first_token_distribution(config, logits, draw_draft, draws=6000):
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(draws):
        drafts, draft_probs = draw_draft(generator)
        kept, following = verify(config, logits, drafts, draft_probs, generator)
        counts[int(drafts[0]) if kept else following] += 1
    return counts / draws


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
def test_speculative_sampling_keeps_the_full_models_distribution(drafter):
    """Total variation between the first emitted token's frequencies and the full model's
    filtered distribution stays at the sampling noise level (6000 draws: about 0.01)."""
    vocab = 6
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 2
    config = SamplingConfig(do_sample=True, temperature=0.8, top_p=0.95)
    target = config.probabilities(logits)[0]
    draft_dist = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(4)), -1)

    def draw_draft(generator):
        if drafter == "one-hot":  # an n-gram guess: always the same token, probability 1
            return torch.tensor([2]), None
        token = torch.multinomial(draft_dist, 1, generator=generator)
        return token, draft_dist[None]

    frequencies = _first_token_distribution(config, logits, draw_draft)
    total_variation = 0.5 * (frequencies - target).abs().sum().item()
    assert total_variation < 0.03, (frequencies, target)
    # the same test catches a wrong rule: always keeping the draft is far off
    assert 0.5 * (torch.nn.functional.one_hot(torch.tensor(2), vocab) - target).abs().sum() > 0.2


def test_ngram_drafter_proposes_what_followed_the_latest_earlier_occurrence():
    drafter = NGramDrafter([5, 6, 7, 8, 9, 5, 6], max_n=3)
    assert drafter.propose(3) == [7, 8, 9]        # "5 6" occurred before, followed by 7 8 9
    drafter.extend([1])
    assert drafter.propose(2) == []               # "6 1", "1": never seen before
    drafter.extend([5, 6, 7])
    assert drafter.propose(4) == [8, 9, 5, 6]     # the longest suffix "5 6 7": first occurrence
    drafter.extend([2, 5, 6, 7])
    assert drafter.propose(2) == [2, 5]           # now the latest "5 6 7" was followed by 2
    assert NGramDrafter([1, 2, 3]).propose(4) == []


def test_ngram_drafter_continues_a_loop_past_the_end():
    assert NGramDrafter([4, 7, 8, 7, 8]).propose(5) == [7, 8, 7, 8, 7]   # "7 8" ended at 3
    assert NGramDrafter([9, 9, 9]).propose(3) == [9, 9, 9]


def test_a_rows_draft_length_follows_its_acceptance():
    assert next_draft_length(4, 4, 4, 10) == 8      # all kept: twice as many
    assert next_draft_length(8, 8, 8, 10) == 10     # up to the engine's most
    assert next_draft_length(10, 10, 3, 10) == 4    # a rejection: one past the kept ones
    assert next_draft_length(4, 4, 0, 10) == 1
    assert next_draft_length(4, 2, 2, 10) == 4      # fewer asked (the row's end): no evidence


def test_draft_speedup_prices_acceptance_against_draft_cost():
    assert draft_speedup(1.0, 0.0, 4) == 5.0                     # free, always kept: 5 a step
    assert draft_speedup(0.0, 0.5, 4) == pytest.approx(1 / 3)    # never kept: 3 steps' time
    assert draft_speedup(0.95, 0.43, 4) > 1.5 > draft_speedup(0.6, 0.45, 4) * 1.5


def test_quant_rows_copy_a_repeat_and_draft_the_rest_at_the_lower_level():
    """'quant' rows whose last two tokens occurred before take the n-gram's continuation (no
    drafter forward); the others draft with the lower-level step."""
    from rbcompile.runtime.engine.drafters import LightDrafter
    from rbcompile.runtime.engine.requests import EngineRequest
    from rbcompile.runtime.engine.speculation import Speculation

    calls = []

    def forward(step, tokens, offset):
        calls.append(list(tokens))
        logits = torch.zeros(len(tokens), 50)
        logits[:, 7] = 1.0
        return logits

    speculation = Speculation(4, quant=LightDrafter(step=None, threshold=0.0, level="int8"))
    repeat = EngineRequest([1, 2, 3, 4, 1], 16, speculate="quant")
    fresh = EngineRequest([10, 11, 12, 13, 14], 16, speculate="quant")
    for request, first in ((repeat, 2), (fresh, 15)):     # the prefill gave their first token
        speculation.start(request)
        request.row.tokens.append(first)
        speculation.extend(request, first)
    proposals = speculation.propose([repeat, fresh], 4, forward, [None, None])
    assert proposals[0].tokens == [3, 4, 1, 2]      # "1 2" occurred before: what followed it
    assert proposals[1].tokens == [7, 7, 7, 7]      # the lower level's argmax, 4 forwards
    assert calls == [[2, 15], [2, 7], [2, 7], [2, 7]]   # the batch's rows, the fresh one drafting
