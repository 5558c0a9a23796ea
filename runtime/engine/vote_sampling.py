"""Self-consistency on the batch engine: the k samples of one prompt as forked requests, their
texts voted on as they finish (consistency.py's `Voter`).

Calls go one way. `sample_and_vote` submits the k samples to a `BatchEngine` as one group (one
prefill, its row forked into k rows, sample i seeded `seed + i`); once the vote is decided the
rows still running are cancelled (with `draw='waves'`, samples are drawn a few at a time and a
decided vote leaves the rest undrawn). `RoutedGroup` is `consistency='auto'`: the greedy row's
prefill logits and the prompt go to the complexity router (consistency_router.py), which picks
1, 3 or 7 samples. `start_vote` puts a vote on any engine: `generate` steps one of its own,
`serve` the shared one, whose other rows keep decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from time import perf_counter
from typing import Callable

from rbcompile.artifact.executors import fastest_level
from rbcompile.errors import UserError
from rbcompile.runtime.engine.consistency import CONSISTENCY_SAMPLES, Vote, VoteOptions, Voter
from rbcompile.runtime.engine.consistency_router import find_router, prompt_features
from rbcompile.runtime.engine.generation import check_prompts
from rbcompile.runtime.engine.prefix_cache import PrefixCache
from rbcompile.runtime.engine.requests import EngineRequest
from rbcompile.runtime.engine.sampling import SamplingConfig


@dataclass
class Sample:
    """One of the samples drawn (in seed order)."""
    seed: int | None
    tokens: list[int]             # generated so far (EOS included); partial when cancelled
    finish_reason: str            # 'stop', 'length' or 'cancelled'
    text: str | None = None       # None when cancelled
    answer: str | None = None     # normalised; None when it had none or was cancelled
    voted: bool = False           # counted (samples finishing after the decision are not)


@dataclass
class ConsistencyStats:
    samples: int                  # k asked for
    voted: int                    # samples counted before the vote was decided
    new_tokens: int               # over all rows, cancelled ones included
    prefills: int                 # forwards over the prompt (1: the samples share one)
    decode_steps: int
    stopped_early: bool
    seconds: float
    drawn: int = 0                # samples drawn (with waves, fewer than k once decided)
    tier: int | None = None       # consistency='auto': the router's number of samples
    weights: str | None = None    # the weight level its tier asked (None: the decoder's)


@dataclass
class ConsistencyResult:
    """The voted answer, its votes, the text of the first sample that gave it, every sample and
    the stats."""
    vote: Vote
    text: str | None
    samples: list[Sample]
    stats: ConsistencyStats

    @property
    def answer(self) -> str | None:
        return self.vote.answer

    @property
    def votes(self) -> dict[str, int]:
        return self.vote.votes


class SampleGroup:
    """The k samples of one prompt on a `BatchEngine` (whose thread runs the callbacks), each
    finished row's text voted on as it arrives. Drawn at once as one group (rows still running
    cancelled once the vote is decided), or with `VoteOptions.draw='waves'` and an early stop
    in waves of `Voter.needed()` samples, the next wave submitted when one has finished
    undecided.

    `lead`: a request already running on the prompt (consistency='auto''s greedy row), counted
    as the vote's first member: the group draws k - 1 samples (seeded `seed`, `seed + 1`, ...),
    and samples finishing before the lead are counted after it, so ties go to its answer."""

    def __init__(self, engine, prompt: list[int], k: int, *, max_new_tokens: int,
                 sampling: SamplingConfig, stop: list[str] | None = None,
                 budget: float | None = None, options: VoteOptions = VoteOptions(),
                 on_token: Callable[[int], None] | None = None, keep_first_logits: bool = False,
                 lead=None, client: str | None = None, priority: int = 1,
                 weights: str | None = None):

        if engine.decode is None:
            raise UserError("self-consistency needs the artifact's tokenizer (answers are "
                            "extracted from text)")
        self.engine, self.voter, self.texts, self.lead = engine, Voter(k, options), {}, lead
        self.weights = weights
        self.voted: list[EngineRequest] = []   # in the order counted
        self.held: list[EngineRequest] = []    # finished before the lead, counted after it
        drawn = k - (lead is not None)
        self.seeds = [None if sampling.seed is None else sampling.seed + i for i in range(drawn)]
        self.requests = [EngineRequest(prompt, max_new_tokens, replace(sampling, seed=seed),
                                       list(stop or []), budget, priority, client=client,
                                       on_token=on_token, on_finish=self._finished,
                                       keep_first_logits=keep_first_logits, weights=weights)
                         for seed in self.seeds]
        self.waves = options.draw == "waves" and options.early_stop != "off"
        self.drawn = 0
        if lead is not None:
            lead.on_finish = self._finished
            self.requests.insert(0, lead)
            self.seeds.insert(0, lead.sampling.seed if lead.sampling.do_sample else None)
            self.drawn = 1
        self._draw()

    @property
    def done(self) -> bool:
        return all(request.finish_reason is not None for request in self.requests[:self.drawn])

    @property
    def new_tokens(self) -> int:
        """Tokens generated by the samples drawn (the lead's included), cancelled rows too."""
        return sum(len(request.tokens) for request in self.requests[:self.drawn])

    def _draw(self) -> None:
        """Draw the next samples: all, or a wave of those that could decide the vote with the
        ones still running."""
        running = self.drawn - len(self.voted) - len(self.held)
        count = (max(self.voter.needed() - running, 1) if self.waves
                 else len(self.requests))
        wave = self.requests[self.drawn:self.drawn + count]
        self.drawn += len(wave)
        if wave:
            self.engine.submit_samples(wave)

    def _finished(self, request) -> None:
        if request.finish_reason in ("stop", "length"):
            tokens = request.tokens
            tokens = tokens[:-1] if tokens[-1] in self.engine.eos else tokens
            self.texts[request] = self.engine.decode(tokens)[:request.row.text_end]
        if request is self.lead:
            for other in [request, *self.held]:
                if other in self.texts:
                    self._count(other)
            self.held = []
        elif request in self.texts:
            if self.lead is not None and self.lead.finish_reason is None:
                self.held.append(request)
            else:
                self._count(request)

    def _count(self, request) -> None:
        """Vote `request`'s text; cancel the rows still running once decided, else draw the
        next wave when every drawn sample has been counted."""
        if self.voter.decided:
            return
        self.voted.append(request)
        if self.voter.add(self.texts[request]):
            for other in self.requests[:self.drawn]:
                if other.finish_reason is None:
                    self.engine.cancel(other)
        elif len(self.voted) == self.drawn:
            self._draw()

    def cancel(self) -> None:
        """Stop the samples still running (a client gone); no wave is drawn after. On the
        engine's thread, like every change to the group."""
        self.waves = False
        self.requests = self.requests[:self.drawn]
        for request in self.requests:
            if request.finish_reason is None:
                self.engine.cancel(request)

    def result(self, stats: ConsistencyStats) -> ConsistencyResult:
        """Once `done`."""
        vote = self.voter.vote()
        samples = [Sample(seed, request.tokens, request.finish_reason, self.texts.get(request),
                          self.voter.answer(self.texts[request]) if request in self.texts else None,
                          request in self.voted)
                   for seed, request in zip(self.seeds, self.requests[:self.drawn])]
        winners = set(vote.clusters[0].members) if vote.clusters else set()
        text = next((self.texts[request] for request, answer in zip(self.voted, vote.answers)
                     if answer in winners), None)
        return ConsistencyResult(vote, text, samples, stats)


def _check_samples(k: int, sampling: SamplingConfig) -> None:
    if k < 1:
        raise UserError(f"k must be >= 1 samples, got {k}")
    if k > 1 and not sampling.do_sample:
        raise UserError(f"{k} samples need sampling (do_sample=True): greedy ones are identical")


def _engine(compiled, k: int, prefix_cache):

    return compiled.batch_engine(max_batch=k, prefix_cache=prefix_cache or PrefixCache())


def _finish(engine, group, started: float) -> ConsistencyResult:
    """Step `engine` (the group's own) until it is idle, then `group`'s result."""
    while engine.has_work:
        engine.step()
    return vote_result(group, started, engine.stats.prefills, engine.stats.decode_steps)


def vote_result(group, started: float, prefills: int, decode_steps: int) -> ConsistencyResult:
    """The result of a `SampleGroup` or `RoutedGroup` once `done`; `prefills` and
    `decode_steps`: what the engine ran for it (or, on a shared engine, since it started)."""
    samples = getattr(group, "group", group)
    stats = ConsistencyStats(samples=len(samples.requests), voted=len(samples.voted),
                             new_tokens=group.new_tokens, prefills=prefills,
                             decode_steps=decode_steps, stopped_early=samples.voter.vote().early,
                             seconds=perf_counter() - started, drawn=samples.drawn,
                             tier=getattr(group, "tier", None), weights=group.weights)
    return group.result(stats)


def sample_and_vote(compiled, prompt_ids, k: int, *, max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(), stop: list[str] | None = None,
                    budget: float | None = None, options: VoteOptions = VoteOptions(),
                    prefix_cache=None) -> ConsistencyResult:
    """k samples of one prompt (token ids) with the decoder artifact `compiled`, as rows of a
    batch that share the prompt's K/V (one prefill; waves reuse it from the prefix cache),
    voted on as they finish; rows still running when the vote is decided are cancelled.
    Sample i samples with seed `sampling.seed + i`; k > 1 needs `sampling.do_sample` (greedy
    samples would all be the same). `prefix_cache` (a `PrefixCache`) may be shared across
    calls, e.g. prompts with one few-shot prefix; default: one for this call."""
    _check_samples(k, sampling)
    started = perf_counter()
    engine = _engine(compiled, k, prefix_cache)
    group = SampleGroup(engine, [int(token) for token in prompt_ids], k,
                        max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                        budget=budget, options=options,
                        weights=tier_levels(compiled, engine, options.tier_weights, (k,)).get(k))
    return _finish(engine, group, started)


class RoutedGroup:
    """`consistency='auto'` for one prompt on a `BatchEngine`: its greedy row joins the batch;
    when its prefill's first token arrives, the router (`ComplexityRouter`) reads the prompt
    and that prefill's logits and picks 1, 3 or 7 votes. 1: the greedy row's answer; 3 or 7:
    the greedy row goes on as the vote's first member (ties go to it) and a `SampleGroup` draws
    the other 2 or 6 as samples, whose prompt K/V come from the engine's prefix cache when it
    has one. `tiers`: the weight level of each tier's decode steps (`tier_levels`)."""

    def __init__(self, engine, prompt: list[int], router, *, max_new_tokens: int,
                 sampling: SamplingConfig, stop: list[str] | None = None,
                 budget: float | None = None, options: VoteOptions = VoteOptions(),
                 client: str | None = None, priority: int = 1,
                 tiers: dict[int, str] | None = None):
        _check_samples(max(router.tiers), sampling)
        self.engine, self.prompt, self.router, self.tier = engine, prompt, router, None
        self.tiers, self.weights = tiers or {}, None
        for level in self.tiers.values():   # before the greedy row is queued
            engine.levels.check(level)
        self.features: list[float] | None = None
        self.options = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                            budget=budget, options=options, client=client, priority=priority)
        self.greedy = SampleGroup(engine, prompt, 1, **{**self.options, "sampling": replace(
            sampling, do_sample=False)}, on_token=self._route, keep_first_logits=True)
        self.group = self.greedy

    def _route(self, token: int) -> None:
        if self.tier is not None:
            return

        self.features = prompt_features(self.engine.decode(self.prompt),
                                        self.greedy.requests[0].first_logits)
        self.tier = self.router.tier(self.features)
        self.weights = self.greedy.requests[0].weights = self.tiers.get(self.tier)
        if self.tier > 1:
            self.group = SampleGroup(self.engine, self.prompt, self.tier, **self.options,
                                     lead=self.greedy.requests[0], weights=self.weights)

    @property
    def done(self) -> bool:
        return self.group.done

    def cancel(self) -> None:
        """Stop every row (a client gone); a tier not chosen yet is never drawn."""
        self.tier = 1 if self.tier is None else self.tier
        self.group.cancel()

    @property
    def new_tokens(self) -> int:
        """Every row's tokens (the greedy row is the vote's first member)."""
        return self.group.new_tokens

    def result(self, stats: ConsistencyStats) -> ConsistencyResult:
        return self.group.result(stats)


def vote_rows(consistency) -> int:
    """Batch rows a vote may hold at once: its samples ('auto': the largest tier)."""
    return max(CONSISTENCY_SAMPLES) if consistency == "auto" else max(consistency, 1)


def check_vote(consistency, *, speculate: str, stream: bool, sampling: SamplingConfig) -> None:
    """A one-line UserError for options a vote does not take."""
    if consistency != "auto" and (type(consistency) is not int
                                  or consistency not in CONSISTENCY_SAMPLES):
        raise UserError(f"consistency must be 'off', 1, 3, 7 or 'auto', got {consistency!r}")
    if speculate != "off":
        raise UserError(f"consistency={consistency} does not combine with speculate={speculate!r}")
    if stream:
        raise UserError("consistency does not stream: the answer is known once the vote is decided")
    if consistency == "auto" and not sampling.do_sample:
        raise UserError("consistency='auto' needs sampling (do_sample=True) for its 3- and "
                        "7-sample tiers")


def start_vote(compiled, engine, prompt: list[int], consistency, *, options: VoteOptions,
               **sample_options):
    """The samples of a vote on one prompt (token ids), submitted to `engine`, whose thread
    (the caller's, or a server's model thread) must run this: a `SampleGroup` of
    `consistency` samples, or for 'auto' a `RoutedGroup` with the artifact's router.
    `sample_options`: SampleGroup's (max_new_tokens, sampling, stop, budget)."""
    tiers = tier_levels(compiled, engine, options.tier_weights,
                        CONSISTENCY_SAMPLES if consistency == "auto" else (consistency,))
    if consistency == "auto":

        return RoutedGroup(engine, prompt, find_router(compiled, options.router), options=options,
                           tiers=tiers, **sample_options)
    _check_samples(consistency, sample_options["sampling"])
    return SampleGroup(engine, prompt, consistency, options=options,
                       weights=tiers.get(consistency), **sample_options)


def tier_levels(compiled, engine, tier_weights, samples=CONSISTENCY_SAMPLES) -> dict[int, str]:
    """The weight level of each of the tiers `samples` that asks one of its own
    (`VoteOptions.tier_weights`; 'auto': where a level measured faster than fp32 at k rows),
    each checked by `engine` (a one-line UserError where the quality guard refuses it)."""
    if tier_weights == "auto":
        found = {k: fastest_level(compiled.manifest, compiled.guard, k,
                                  compiled.decoder.prefill) for k in samples}
        tier_weights = {k: level for k, level in found.items()
                        if level != compiled.decoder.weights}
    levels = {k: level for k, level in (tier_weights or {}).items() if k in samples}
    for level in levels.values():
        engine.levels.check(level)
    return levels


def generate_voted(compiled, input_ids, attention_mask, consistency, *, vote: VoteOptions | None,
                   speculate: str, stream: bool, prefix_cache=None, **options) -> ConsistencyResult:
    """`CompiledModel.generate(..., consistency=k or 'auto')`: checks the options (one-line
    errors), then the vote on the one prompt with an engine of its own (and a prefix cache,
    so waves and 'auto''s samples reuse the prompt's K/V); `options` are SampleGroup's."""

    check_vote(consistency, speculate=speculate, stream=stream, sampling=options["sampling"])
    prompt_ids, pads = check_prompts(input_ids, attention_mask)
    if prompt_ids.shape[0] != 1:
        raise UserError(f"consistency votes over the samples of one prompt; got a batch of "
                        f"{prompt_ids.shape[0]}")
    started = perf_counter()
    engine = _engine(compiled, vote_rows(consistency), prefix_cache)
    prompt = [int(token) for token in prompt_ids[0, int(pads[0]):]]
    group = start_vote(compiled, engine, prompt, consistency, options=vote or VoteOptions(),
                       **options)
    return _finish(engine, group, started)
