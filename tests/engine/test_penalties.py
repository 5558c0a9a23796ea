"""Penalties and logit bias (runtime/engine/penalties.py): vLLM's semantics, HF's repetition
penalty token for token, and exact with drafting (a row drafted by n-grams gets the tokens it
gets without drafts)."""
import torch
from shared import DECODER_PROMPTS

from rbcompile.runtime.engine.penalties import Penalties, penalize
from rbcompile.runtime.engine.requests import EngineRequest
from rbcompile.runtime.engine.sampling import SamplingConfig


def test_each_penalty_and_the_bias_as_vllm_applies_them():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    assert torch.equal(penalize(Penalties(), logits, [0], [1]), logits)
    repeated = penalize(Penalties(repetition=2.0), logits, [0], [1])   # prompt and output
    assert repeated.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    counted = penalize(Penalties(presence=0.5, frequency=0.25), logits, [0], [1, 1, 2])
    assert counted.tolist() == [[2.0, -3.0, 0.25, 0.5]]   # the prompt's token 0 is not counted
    assert penalize(Penalties(bias=((3, 10.0),)), logits, [], []).tolist() == [[2.0, -2.0, 1.0, 10.5]]


def test_a_draft_counts_from_the_position_after_it():
    logits = torch.zeros(3, 4)
    rows = penalize(Penalties(frequency=1.0), logits, [], [0], drafts=[2, 2])
    assert rows.tolist() == [[-1, 0, 0, 0], [-1, 0, -1, 0], [-1, 0, -2, 0]]


def _engine_tokens(compiled, penalties, speculate="off", new=12):
    engine = compiled.batch_engine(max_batch=2)
    prompt = DECODER_PROMPTS[1].tolist()
    request = engine.submit(EngineRequest(prompt, new, SamplingConfig(penalties=penalties),
                                          speculate=speculate))
    while engine.has_work:
        engine.step()
    return prompt, request.tokens


def test_repetition_penalty_gives_hf_greedy_tokens_with_and_without_drafts(compiled_tiny):
    compiled, eager = compiled_tiny["llama"]
    penalties = Penalties(repetition=1.3)
    prompt, tokens = _engine_tokens(compiled, penalties)
    expected = eager.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.3)[0, len(prompt):].tolist()
    assert tokens == expected[:len(tokens)] and len(tokens) >= 1
    assert _engine_tokens(compiled, penalties, "ngram")[1] == tokens
    plain = _engine_tokens(compiled, None)[1]
    counted = Penalties(frequency=1.5, presence=0.5)
    assert _engine_tokens(compiled, counted, "ngram")[1] == _engine_tokens(compiled, counted)[1]
    assert _engine_tokens(compiled, counted)[1] != plain   # a test that can tell them apart


def test_a_strong_bias_chooses_its_token(compiled_tiny):
    compiled, _ = compiled_tiny["llama"]
    tokens = _engine_tokens(compiled, Penalties(bias=((7, 100.0),)), new=5)[1]
    assert tokens == [7] * len(tokens) and tokens


def test_min_p_drops_the_unlikely_tail():
    config = SamplingConfig(do_sample=True, min_p=0.5)
    probabilities = config.probabilities(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    assert torch.allclose(probabilities, torch.tensor([[0.625, 0.375, 0.0]]))
