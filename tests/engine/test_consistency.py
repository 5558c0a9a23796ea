"""Self-consistency (runtime/engine/consistency.py): answers extracted and normalised, voted on with a
semantic tie-break, an early stop that never changes a decided vote, and the k samples of one
prompt sharing one prefill in the batch engine (tiny llama; one test with the real minilm-l6)."""
import random
from math import comb

import numpy
import pytest
import torch
import torch.nn.functional as F

from rbcompile.errors import UserError
from rbcompile.runtime.engine.consistency import (
    VoteOptions,
    Voter,
    choice_letter,
    extractor,
    first_line,
    last_number,
    leader_probability,
    majority_vote,
    minilm_embed,
    normalise,
    tally,
)
from rbcompile.runtime.engine.core import EngineRequest
from rbcompile.runtime.engine.sampling import SamplingConfig
from rbcompile.runtime.engine.vote_sampling import sample_and_vote

PROMPT = [21, 22, 23, 21, 22]
SAMPLED = SamplingConfig(do_sample=True, temperature=1.0, seed=5)
FIRST_WORD = VoteOptions(extract=lambda text: text.split()[0] if text.split() else None,
                         early_stop="off")


def fake_embed(groups: list[set[str]]):
    """An `embed` giving the answers of one group one direction and every other answer its own
    (orthogonal ones), recording its calls."""
    directions: dict[str, int] = {}

    def embed(texts):
        embed.calls.append(list(texts))
        names = [next((min(group) for group in groups if text in group), text) for text in texts]
        indices = [directions.setdefault(name, len(directions)) for name in names]
        return F.one_hot(torch.tensor(indices), 64).float()
    embed.calls = []
    return embed


def cosines(embed):
    """`tally`'s similarity from an `embed`."""
    def similarity(answers):
        vectors = F.normalize(embed(answers), dim=-1)
        return vectors @ vectors.T
    return similarity


# ---- extraction and normalisation ----------------------------------------------------------

@pytest.mark.parametrize("raw,expected", [
    ("7.0", "7"), ("+7", "7"), ("7.", "7"), ("The answer is 7.00!", "the answer is 7"),
    ("1,000", "1000"), ("-0.0", "0"), (".50", "0.5"), ("3-4", "3 4"),
    ("  Paris,   FRANCE. ", "paris france"), ("¿Qué?", "qué"), ("!!!", None),
])
def test_normalise(raw, expected):
    assert normalise(raw) == expected


def test_extractors():
    text = "\n  \nFirst, 3 apples.\nThey cost 4.50 dollars; the answer is (C).\n"
    assert first_line(text) == "First, 3 apples." and first_line("  \n") is None
    assert last_number(text) == "4.50" and last_number("none here") is None
    assert normalise(last_number("x = 1,250.0")) == "1250"
    assert choice_letter(text) == "C"
    assert [choice_letter(t) for t in ("Answer: b", "B) Paris", "E", "(D) and (A)", "A cat sat")] \
        == [None, "B", "E", "D", None]
    assert extractor("regex:answer is (\\w+)")("so the answer is forty.") == "forty"
    assert extractor("regex:\\d+")("abc 42 7") == "42"           # no group: the whole match
    assert extractor("last-number")("4 then 5") == "5"
    assert extractor(str.upper)("x") == "X"


# ---- the vote ------------------------------------------------------------------------------

def test_majority_and_ties_go_to_the_first_arrival():
    vote = majority_vote(["b", "A", "a.", "B", "c"], VoteOptions(early_stop="off"))
    assert vote.answer == "b" and vote.votes == {"b": 2, "a": 2, "c": 1}   # b arrived first
    assert majority_vote(["x", "y", "y"]).answer == "y"
    empty = majority_vote(["", "  "])
    assert empty.answer is None and empty.votes == {}


def test_near_duplicates_merge_and_decide_a_tie():
    answers = ["London", "Paris", "paris, France", "the city of Paris", "London", "Rome"]
    assert majority_vote(answers).answer == "london"                     # 2 against 1, 1, 1
    embed = fake_embed([{"paris", "paris france", "the city of paris"}])
    vote = majority_vote(answers, VoteOptions(embed=embed))
    assert vote.answer == "paris" and vote.votes == {"paris": 3, "london": 2, "rome": 1}
    assert vote.clusters[0].members == ["paris", "paris france", "the city of paris"]
    tied = ["Paris", "London", "London", "paris, France"]
    assert majority_vote(tied).answer == "london"
    tie = majority_vote(tied, VoteOptions(embed=fake_embed([{"paris", "paris france"}])))
    assert tie.votes == {"paris": 2, "london": 2} and tie.answer == "paris"   # arrived first


def test_answers_with_digits_are_only_compared_exactly():
    alike = fake_embed([{"7", "8", "7 apples", "8 apples", "seven", "eight"}])
    vote = majority_vote(["7", "8", "8.0", "7 apples", "8 apples", "seven", "eight"],
                         VoteOptions(embed=alike))
    assert vote.votes == {"8": 2, "seven": 2, "7": 1, "7 apples": 1, "8 apples": 1}
    assert alike.calls == [["seven", "eight"]]   # the numbers are never embedded


def test_each_distinct_answer_is_embedded_once():
    embed = fake_embed([])
    voter = Voter(5, VoteOptions(embed=embed, early_stop="off"))
    for text in ["a", "b", "a", "b", "c"]:
        voter.add(text)
    assert embed.calls == [["a", "b"], ["c"]]   # from the second distinct answer on


def test_clusters_do_not_depend_on_the_order_of_arrival():
    embed = fake_embed([{"x", "xx"}, {"y", "yy"}])
    answers = ["x", "y", "xx", "yy", "z", "x"]
    expected = sorted(sorted(c.members) for c in tally(answers, cosines(embed)))
    assert expected == [["x", "xx"], ["y", "yy"], ["z"]]
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(answers)
        assert sorted(sorted(c.members) for c in tally(answers, cosines(embed))) == expected


def test_leader_probability_is_the_exact_posterior():
    def beta_tail(a, b):   # P(Beta(a + 1, b + 1) > 1/2) = P(Binomial(a + b + 1, 1/2) <= a)
        n = a + b + 1
        return sum(comb(n, j) for j in range(a + 1)) / 2 ** n
    for a, b in [(3, 0), (4, 0), (5, 1), (2, 2), (6, 3), (1, 0)]:
        assert leader_probability([a, b]) == pytest.approx(beta_tail(a, b), abs=1e-12)
    assert leader_probability([3, 0]) == 15 / 16 and leader_probability([2, 2]) == 0.5
    counts = [4, 2, 1]
    draws = numpy.random.default_rng(0).dirichlet(numpy.array(counts) + 1.0, 200_000)
    assert leader_probability(counts) == pytest.approx((draws.argmax(-1) == 0).mean(), abs=0.005)
    assert leader_probability(counts) < leader_probability(counts[:2])   # a third answer


def random_answers(rng: random.Random, k: int) -> list[str]:
    weights = [rng.random() ** 2 for _ in range(4)]
    return rng.choices(["a", "b", "c", "d"], weights, k=k)


def decide(answers: list[str], options: VoteOptions):
    """(answer when decided, samples seen) feeding `answers` in order."""
    voter = Voter(len(answers), options)
    for seen, text in enumerate(answers, 1):
        if voter.add(text):
            return voter.vote().answer, seen


@pytest.mark.parametrize("embed", [None, fake_embed([{"a", "b"}])], ids=["exact", "merging"])
def test_early_stop_never_changes_a_decided_vote(embed):
    """Over many candidate sets and arrival orders: the leader at an 'overtake' stop is the
    answer all samples give; 'adaptive' stops no later, and at confidence 1 exactly as late."""
    rng = random.Random(1)
    stopped = 0
    for trial in range(600):
        answers = random_answers(rng, rng.choice([3, 5, 7, 9]))
        full = majority_vote(answers, VoteOptions(embed=embed))
        answer, seen = decide(answers, VoteOptions(embed=embed, early_stop="overtake"))
        assert answer in next(c.members for c in full.clusters if c.answer == full.answer), answers
        stopped += seen < len(answers)
        criterion = ("beta", "dirichlet")[trial % 2]
        adaptive = decide(answers, VoteOptions(embed=embed, criterion=criterion, confidence=0.8))[1]
        assert adaptive <= seen
        assert decide(answers, VoteOptions(embed=embed, confidence=1.0))[1] == seen
    assert stopped > 300   # the rule does stop early


def test_adaptive_consistency_stops_before_the_leader_is_safe():
    """4 of 4 agree out of 9: the leader could still be overtaken (5 to come), but its posterior
    probability of being the majority is 1 - 2^-5 >= 0.95."""
    answers = ["a"] * 4 + ["b"] * 5
    assert decide(answers, VoteOptions(early_stop="overtake")) == ("b", 9)
    assert decide(answers, VoteOptions()) == ("a", 4)
    assert decide(answers, VoteOptions(confidence=0.99)) == ("b", 9)
    voter = Voter(9)
    for text in answers[:4]:
        voter.add(text)
    with pytest.raises(RuntimeError, match="already decided"):
        voter.add("b")


# ---- sampling on a shared prefix -------------------------------------------------------------

class CountingDecoder:
    """The artifact's decoder, recording the input shape of every forward."""

    def __init__(self, decoder):
        self.decoder, self.shapes = decoder, []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def __call__(self, input_ids, *args, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return self.decoder(input_ids, *args, **kwargs)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    import rbcompile
    return rbcompile.compile(tiny_checkpoints["llama"])


def test_k_samples_share_one_prefill_and_each_gets_its_tokens_alone(llama, monkeypatch):
    counting = CountingDecoder(llama.decoder)
    monkeypatch.setattr(llama, "decoder", counting)
    result = sample_and_vote(llama, PROMPT, 7, max_new_tokens=10, sampling=SAMPLED,
                             options=FIRST_WORD)
    prefills = [shape for shape in counting.shapes if shape[1] > 1]
    assert prefills == [(1, len(PROMPT))] and result.stats.prefills == 1
    assert len(counting.shapes) == 1 + result.stats.decode_steps
    assert max(shape[0] for shape in counting.shapes[1:]) == 7     # the 7 rows decode together
    monkeypatch.undo()
    for i, sample in enumerate(result.samples):
        alone = llama.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=True,
                               seed=5 + i)
        assert sample.seed == 5 + i and sample.tokens == alone.tokens[0] and sample.voted
    assert len({tuple(sample.tokens) for sample in result.samples}) > 1
    assert result.stats.new_tokens == sum(len(sample.tokens) for sample in result.samples)
    assert result.votes == majority_vote([s.text for s in result.samples], FIRST_WORD).votes


def test_seeded_runs_repeat(llama):
    runs = [llama.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=True, seed=11,
                           consistency=3, vote=FIRST_WORD) for _ in range(2)]
    assert [s.tokens for s in runs[0].samples] == [s.tokens for s in runs[1].samples]
    assert runs[0].votes == runs[1].votes and runs[0].answer == runs[1].answer
    assert runs[0].answer == normalise(FIRST_WORD.extract(runs[0].text))
    greedy = llama.generate(torch.tensor([PROMPT]), max_new_tokens=8, consistency=1)
    alone = llama.generate(torch.tensor([PROMPT]), max_new_tokens=8).tokens[0]
    assert greedy.samples[0].tokens == alone and greedy.votes == {greedy.answer: 1}


def test_a_decided_vote_cancels_the_rows_still_running(llama):
    """Rows end at different steps (many stop words); every answer is the same, so 4 of 7 decide
    the vote and the rows still running are cancelled with fewer tokens."""
    words = llama.tokenizer.decode(list(range(4, 40))).split()
    result = sample_and_vote(llama, PROMPT, 7, max_new_tokens=40, sampling=SAMPLED,
                             stop=words, options=VoteOptions(extract=lambda text: "same"))
    reasons = [sample.finish_reason for sample in result.samples]
    assert result.answer == "same" and result.votes == {"same": 4} and result.stats.voted == 4
    assert result.stats.stopped_early and "cancelled" in reasons
    cancelled = [sample for sample in result.samples if sample.finish_reason == "cancelled"]
    assert all(sample.text is None and not sample.voted for sample in cancelled)
    assert result.stats.new_tokens < 7 * 40


def test_engine_groups_wait_for_rows_and_keep_single_requests_as_they_were(llama):
    engine = llama.batch_engine(max_batch=3)
    single = engine.submit(EngineRequest([40, 41, 42], 6))
    group = engine.submit_samples([EngineRequest(PROMPT, 4, SamplingConfig(True, seed=i))
                                   for i in range(3)])
    assert engine.queued == 4 and engine.queued_by_priority() == {1: 4}
    engine.step()
    assert engine.running == [single] and engine.queued == 3   # 1 + 3 rows > 3: the group waits
    while engine.has_work:
        engine.step()
    assert engine.stats.prefills == 2
    assert single.tokens == llama.generate(torch.tensor([[40, 41, 42]]), max_new_tokens=6).tokens[0]
    for i, request in enumerate(group):
        assert request.tokens == llama.generate(torch.tensor([PROMPT]), max_new_tokens=4,
                                                do_sample=True, seed=i).tokens[0]
    with pytest.raises(UserError, match="a group of 4 samples needs as many rows"):
        engine.submit_samples([EngineRequest(PROMPT, 4)] * 4)
    with pytest.raises(UserError, match="must share one prompt"):
        engine.submit_samples([EngineRequest(PROMPT, 4), EngineRequest([7], 4)])


@pytest.mark.parametrize("options,message", [
    ({"consistency": "auto", "do_sample": True}, "no complexity router for this artifact"),
    ({"consistency": "auto"}, "'auto' needs sampling"),
    ({"consistency": 5}, "consistency must be 'off', 1, 3, 7 or 'auto', got 5"),
    ({"consistency": True}, "consistency must be 'off', 1, 3, 7 or 'auto', got True"),
    ({"consistency": 3}, "3 samples need sampling"),
    ({"consistency": 3, "do_sample": True, "speculate": "ngram"}, "does not combine with spec"),
    ({"consistency": 3, "do_sample": True, "stream": True}, "does not stream"),
    ({"consistency": 3, "do_sample": True, "input_ids": [PROMPT, PROMPT]}, "a batch of 2"),
    ({"vote": VoteOptions()}, "vote options need consistency"),
])
def test_bad_options_are_one_line_errors(llama, options, message):
    options = {"input_ids": [PROMPT], "max_new_tokens": 4, **options}
    with pytest.raises(UserError, match=message) as error:
        llama.generate(torch.tensor(options.pop("input_ids")), **options)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("options,message", [
    ({"threshold": 0}, "threshold must be in"), ({"early_stop": "never"}, "unknown early_stop"),
    ({"confidence": 0.5}, "confidence must be in"), ({"criterion": "gamma"}, "unknown criterion"),
    ({"extract": "regex:("}, "bad answer regex"),
    ({"extract": "last-word"}, "unknown answer extractor"),
    ({"draw": "some"}, "unknown draw"),
])
def test_bad_vote_options_are_one_line_errors(options, message):
    with pytest.raises(UserError, match=message) as error:
        VoteOptions(**options)
    assert "\n" not in str(error.value)


def test_minilm_merges_paraphrases(minilm):
    embed = minilm_embed(minilm[0])
    answers = ["London", "Paris", "paris, France", "London", "the city of Paris", "Rome"]
    assert majority_vote(answers).answer == "london"
    vote = majority_vote(answers, VoteOptions(embed=embed, threshold=0.85))
    assert vote.votes == {"paris": 3, "london": 2, "rome": 1}, vote.votes


# ---- waves and the complexity router (consistency="auto") -------------------------------------

LONG_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]


def test_needed_is_the_fewest_agreeing_samples_that_decide():
    """`Voter.needed()` more answers agreeing with the leader decide the vote; one fewer does not."""
    assert Voter(7).needed() == 4 and Voter(3).needed() == 2 and Voter(1).needed() == 1
    rng = random.Random(2)
    for trial in range(300):
        k = rng.choice([3, 5, 7])
        options = VoteOptions(early_stop=("overtake", "adaptive")[trial % 2])
        voter = Voter(k, options)
        for text in random_answers(rng, rng.randrange(k)):
            if voter.add(text):
                break
        if voter.decided:
            continue
        needed = voter.needed()
        leader = voter.clusters[0].answer if voter.clusters else "new"
        for more, decides in ((needed - 1, False), (needed, True)):
            replay = Voter(k, options)
            answers = voter.answers + [leader] * more
            assert [replay.add(answer) for answer in answers][-1:] in ([], [decides]), answers


def test_waves_draw_only_the_samples_that_could_decide(llama):
    """With waves, 7 agreeing samples stop after the first wave of 4 (never drawn, not
    cancelled); disagreeing ones draw a second wave whose prompt K/V come from the prefix cache;
    every sample keeps the tokens it gets alone, and the vote is the all-at-once vote's."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache

    same = sample_and_vote(llama, LONG_PROMPT, 7, max_new_tokens=6, sampling=SAMPLED,
                           options=VoteOptions(extract=lambda text: "same", draw="waves"))
    assert same.stats.drawn == 4 and same.stats.voted == 4 and same.stats.prefills == 1
    assert "cancelled" not in [s.finish_reason for s in same.samples] and same.votes == {"same": 4}
    cache = PrefixCache()
    waves = sample_and_vote(llama, LONG_PROMPT, 7, max_new_tokens=6, sampling=SAMPLED,
                            options=VoteOptions(extract=lambda text: text, draw="waves",
                                                early_stop="overtake"), prefix_cache=cache)
    at_once = sample_and_vote(llama, LONG_PROMPT, 7, max_new_tokens=6, sampling=SAMPLED,
                              options=VoteOptions(extract=lambda text: text, early_stop="off"))
    assert waves.stats.prefills > 1 and cache.stats.reused_tokens >= 16 * (waves.stats.prefills - 1)
    assert at_once.stats.prefills == 1
    for wave, whole in zip(waves.samples, at_once.samples):
        assert wave.tokens == whole.tokens and wave.seed == whole.seed
    if waves.stats.drawn == 7:
        assert waves.votes == at_once.votes


def test_prompt_features():
    from rbcompile.runtime.engine.consistency_router import FEATURES, prompt_features, question_type

    features = dict(zip(FEATURES, prompt_features("a shot\nWhat is 12 + 7?", torch.zeros(50))))
    assert features["entropy"] == pytest.approx(numpy.log(50)) and features["top_margin"] == 0
    assert features["top_probability"] == pytest.approx(1 / 50)
    assert features["type_reasoning"] == 1 and features["log_words"] == pytest.approx(numpy.log1p(6))
    peaked = dict(zip(FEATURES, prompt_features("x", torch.tensor([10.0, 0.0, 0.0]))))
    assert peaked["entropy"] < 0.01 and peaked["top_margin"] > 0.99
    assert [question_type(t.split()) for t in ("Write a poem", "The capital of Peru is",
                                                "How many legs")] == ["creative", "fact", "reasoning"]


def synthetic_tiers(n: int, seed: int):
    """Feature rows whose tier follows the entropy and number share (with a little noise)."""
    from rbcompile.runtime.engine.consistency_router import FEATURES

    rng = numpy.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES)))
    score = x[:, FEATURES.index("entropy")] + 0.5 * x[:, FEATURES.index("number_share")]
    tiers = numpy.where(score < 0, 1, numpy.where(score < 1, 3, 7))
    return x.tolist(), tiers.tolist()


def test_router_training_is_deterministic_and_learns(tmp_path):
    from rbcompile.runtime.engine.consistency_router import ComplexityRouter, train_router

    x, tiers = synthetic_tiers(300, 0)
    first, again = train_router(x, tiers, seed=3), train_router(x, tiers, seed=3)
    assert first.save(tmp_path / "a.json").read_text() == again.save(tmp_path / "b.json").read_text()
    other = train_router(x, tiers, seed=4)
    assert other.weights != first.weights   # another start: another (nearby) optimum
    test_x, test_tiers = synthetic_tiers(300, 1)
    accuracy = numpy.mean([first.tier(row) == tier for row, tier in zip(test_x, test_tiers)])
    assert accuracy > 0.85, accuracy
    loaded = ComplexityRouter.load(tmp_path / "a.json")
    assert torch.equal(loaded.probabilities(test_x), first.probabilities(test_x))


def test_bad_router_input_is_a_one_line_error(tmp_path, llama):
    from rbcompile.runtime.engine.consistency_router import (
        ComplexityRouter,
        find_router,
        train_router,
    )

    x, tiers = synthetic_tiers(20, 0)
    (tmp_path / "bad.json").write_text('{"mean": [1]}')
    for call, message in [(lambda: train_router(x, tiers[:5]), "router training needs"),
                          (lambda: train_router(x, [2] * 20), "router tiers must be 1, 3 or 7"),
                          (lambda: ComplexityRouter.load(tmp_path / "none.json"), "no complexity router at"),
                          (lambda: ComplexityRouter.load(tmp_path / "bad.json"), "not a complexity router"),
                          (lambda: find_router(llama), "no complexity router for this artifact")]:
        with pytest.raises(UserError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def fixed_router(tier: int, sha256: str | None = None):
    """A router that always picks `tier` (its bias decides)."""
    from rbcompile.runtime.engine.consistency_router import FEATURES, TIERS, ComplexityRouter

    bias = [10.0 if t == tier else 0.0 for t in TIERS]
    return ComplexityRouter([0.0] * len(FEATURES), [1.0] * len(FEATURES),
                            [[0.0] * len(FEATURES) for _ in TIERS], bias,
                            info={"source_sha256": sha256})


def test_auto_runs_the_tier_the_router_picks(llama, monkeypatch, tmp_path):
    """Tier 1: the greedy answer (one prefill). Tier 3: the greedy row goes on as the vote's
    first member and 2 samples reuse its prompt K/V; they are `sample_and_vote`'s first 2
    samples. The shipped router is found by the checkpoint's sha256."""
    import rbcompile.runtime.engine.consistency_router as routers

    prompt = torch.tensor([LONG_PROMPT])
    greedy = llama.generate(prompt, max_new_tokens=6, do_sample=True, seed=5, consistency="auto",
                            vote=VoteOptions(extract=FIRST_WORD.extract, router=fixed_router(1)))
    greedy_tokens = llama.generate(prompt, max_new_tokens=6).tokens[0]
    assert greedy.stats.tier == 1 and greedy.stats.prefills == 1
    assert greedy.samples[0].tokens == greedy_tokens
    fixed_router(3, llama.manifest["source"]["sha256"]).save(tmp_path / "consistency-router-x.json")
    monkeypatch.setattr(routers, "SHIPPED", tmp_path)
    voted = llama.generate(prompt, max_new_tokens=6, do_sample=True, seed=5, consistency="auto",
                           vote=FIRST_WORD)
    three = sample_and_vote(llama, LONG_PROMPT, 3, max_new_tokens=6, sampling=SAMPLED,
                            options=FIRST_WORD)
    assert voted.stats.tier == 3 and voted.stats.prefills == 2 and voted.stats.drawn == 3
    assert [s.tokens for s in voted.samples] == [greedy_tokens] + [s.tokens
                                                                   for s in three.samples[:2]]
    assert [s.seed for s in voted.samples] == [None, 5, 6]
    assert voted.vote.answers[0] == voted.samples[0].answer   # the greedy answer is counted first
    assert voted.stats.new_tokens == sum(len(s.tokens) for s in voted.samples)


def test_the_greedy_lead_wins_ties_and_waves_count_it(llama):
    """A routed vote counts the greedy row first even when samples finish before it (so a tie
    goes to the greedy answer); with waves, tier 7 of agreeing answers draws the greedy row and
    3 samples only."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache
    from rbcompile.runtime.engine.vote_sampling import RoutedGroup, SampleGroup

    def routed(tier, options, sampling=SAMPLED):
        engine = llama.batch_engine(max_batch=8, prefix_cache=PrefixCache(block_tokens=4))
        group = RoutedGroup(engine, LONG_PROMPT, fixed_router(tier), max_new_tokens=6,
                            sampling=sampling, stop=None, options=options)
        while engine.has_work:
            engine.step()
        return group, group.group

    engine = llama.batch_engine(max_batch=4)
    lead = engine.submit(EngineRequest(LONG_PROMPT, 6))
    engine.step()   # its prefill; the 2-token samples drawn now finish before its 6 tokens
    votes = SampleGroup(engine, LONG_PROMPT, 3, max_new_tokens=2, sampling=SAMPLED,
                        options=VoteOptions(extract=lambda text: text, early_stop="off"), lead=lead)
    while engine.has_work:
        engine.step()
    assert votes.voted[0] is votes.requests[0] is lead and len(lead.tokens) == 6
    assert set(votes.voted) == set(votes.requests) and votes.drawn == 3
    texts = [votes.texts[request] for request in votes.voted]
    assert votes.voter.vote().answers == [votes.voter.answer(text) for text in texts]
    if len(set(texts)) == 3:
        assert votes.voter.vote().answer == votes.voter.answer(texts[0])
    group, votes = routed(7, VoteOptions(extract=lambda text: "same", draw="waves"))
    assert votes.drawn == 4 and len(votes.voted) == 4 and votes.voter.vote().votes == {"same": 4}
    assert group.new_tokens == sum(len(request.tokens) for request in votes.requests[:4])


def test_labels_and_the_threshold():
    """A label is the fewest votes (greedy first, ties to it) whose answer is right; the
    threshold sends a question to a vote when tier 1 is not likely enough."""
    from rbcompile.runtime.engine.consistency_router import label_tier, vote_of

    assert vote_of("a", ["b", "c"], 3) == "a" and vote_of("a", ["b", "b"], 3) == "b"
    assert vote_of("a", ["b", "b", "c", "c", "b", "a"], 1) == "a"
    assert label_tier("a", ["b"] * 6, "a") == 1 and label_tier("a", ["b"] * 6, "b") == 3
    assert label_tier("a", ["b", "c", "b", "b", "c", "b"], "b") == 7
    assert label_tier("a", ["b"] * 6, "z") == 1   # no vote is right: voting cannot help
    router = fixed_router(1)
    router.bias = [1.0, 0.0, 0.5]   # P(1) = 0.51
    assert router.tier([0.0] * len(router.features)) == 1
    router.threshold = 0.6
    assert router.tier([0.0] * len(router.features)) == 7


def test_routed_prompts_prefilled_together_are_routed_on_their_own_logits(llama):
    """Two `consistency='auto'` prompts join one engine step (one prefill forward): each is
    routed on its own prompt and its own first-token logits, as it is alone."""
    from rbcompile.runtime.engine.prefix_cache import PrefixCache
    from rbcompile.runtime.engine.vote_sampling import RoutedGroup

    def routed(prompts):
        engine = llama.batch_engine(max_batch=2, prefix_cache=PrefixCache(block_tokens=4))
        groups = [RoutedGroup(engine, prompt, fixed_router(1), max_new_tokens=4, sampling=SAMPLED,
                              options=FIRST_WORD) for prompt in prompts]
        while engine.has_work:
            engine.step()
        return groups, engine.stats.prefill_forwards

    together, forwards = routed([PROMPT, LONG_PROMPT])
    assert forwards == 1
    for group, prompt in zip(together, [PROMPT, LONG_PROMPT]):
        (alone,), _ = routed([prompt])
        assert group.features == pytest.approx(alone.features, abs=1e-6)
    assert together[0].features != pytest.approx(together[1].features)


def test_cli_run_consistency_auto(llama, tmp_path, monkeypatch, capsys):
    """`rbcompile run --consistency auto`: the router's tier and the vote; without a router for
    the checkpoint, one line and exit 2."""
    import rbcompile.runtime.engine.consistency_router as routers
    from rbcompile.frontend.cli import main

    llama.save(tmp_path / "llama")
    argv = ["run", str(tmp_path / "llama"), "--text", "the time of his", "--max-new-tokens", "4",
            "--consistency", "auto", "--temperature", "0.9", "--seed", "2"]
    monkeypatch.setattr(routers, "SHIPPED", tmp_path)
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "no complexity router for this artifact" in error and error.count("\n") == 1
    fixed_router(3, llama.manifest["source"]["sha256"]).save(tmp_path / "consistency-router-x.json")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("'the time of his' -> ")
    assert "router: tier 3 (greedy + 2 samples); votes" in out
    assert "from 3 of 3 answers" in out


def test_question_sets_are_reproducible_and_their_solved_examples_extract():
    """benchmarks/consistency_questions.py: the committed cloze set is what its seed generates,
    the chain set is generated the same way each time, both split in halves with no question
    of the few-shot prefix; each set's extractor reads its solved examples' answers, and the
    chain set's arithmetic answers follow from their questions."""
    import re
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import consistency_questions as questions

    assert questions.generate() == questions.load()
    chain = questions.load(form=questions.CHAIN)
    assert chain == questions.generate(form=questions.CHAIN)
    for form, rows in ((questions.CLOZE, questions.load()), (questions.CHAIN, chain)):
        assert len(rows) == form.count and len({row["question"] for row in rows}) == form.count
        assert sum(row["split"] == "test" for row in rows) == form.count // 2
        assert not {q for q, _ in form.shots} & {row["question"] for row in rows}
        read = extractor(form.extract)
        for question, answer in form.shots:   # the example as laid out = asked + completion
            solved, asked = form.shot.format(q=question, a=answer), form.ask.format(q=question)
            assert solved.startswith(asked) and form.prompt(question).endswith(asked)
            assert normalise(read(solved[len(asked):])) == normalise(answer.split()[-1])
    for row in chain:
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        if row["kind"] == "three-sum":
            assert int(row["answer"]) == sum(numbers)
        elif row["kind"] == "product-minus":
            assert int(row["answer"]) == numbers[0] * numbers[1] - numbers[2]
