"""Self-consistency: k sampled answers to one prompt, extracted, normalised and voted on (Wang et
al. 2023, "Self-Consistency Improves Chain of Thought Reasoning in Language Models"), with a
semantic tie-break and an adaptive early stop.

Calls go one way. `sample_and_vote` submits the k samples to a `BatchEngine` as one group (one
prefill, its row forked into k rows, sample i seeded `seed + i`); as each row finishes, its text
goes to the `Voter` (extract -> normalise -> tally into clusters), and once the vote is decided
the rows still running are cancelled (with `draw='waves'`, samples are drawn a few at a time
and a decided vote leaves the rest undrawn). `RoutedGroup` is
`consistency='auto'`: the greedy row's prefill logits and the prompt go to the complexity router
(consistency_router.py), which picks 1, 3 or 7 samples. With an `embed` callable, answers
whose embeddings have a cosine at or above a threshold are merged into one cluster before
counting (near-duplicates: "paris" and "paris france"); answers with a digit are only compared
exactly (an embedding finds "7" and "8" alike). `start_vote` puts a vote on any engine:
`generate` steps one of its own, `serve` the shared one, whose other rows keep decoding.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction
from math import factorial
from time import perf_counter
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import UserError
from .sampling import SamplingConfig

CONSISTENCY_SAMPLES = (1, 3, 7)   # the tiers `generate(consistency=...)` accepts
EARLY_STOPS = ("adaptive", "overtake", "off")
DRAWS = ("all", "waves")
CRITERIA = ("beta", "dirichlet")
EXTRACTORS = ("first-line", "last-number", "choice", "regex:PATTERN")

# A number standing alone: not glued to a word or another number's dot; thousands commas allowed.
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
CHOICE_PATTERNS = [re.compile(pattern) for pattern in (
    r"(?i:answer)(?:\s+is|\s*:)?\s*\(?([A-E])\b",   # "the answer is (C)", "Answer: B"
    r"\(([A-E])\)",                                  # "(D)"
    r"^\s*([A-E])(?:[).:]|\s*$)",                    # "B) Paris", "C.", "E"
)]


# ---- extraction and normalisation ---------------------------------------------------------------

def first_line(text: str) -> str | None:
    """The first line with something on it."""
    return next((line.strip() for line in text.splitlines() if line.strip()), None)


def last_number(text: str) -> str | None:
    """The last number in the text ('3 apples cost 4.50' -> '4.50')."""
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def choice_letter(text: str) -> str | None:
    """A multiple-choice letter A-E: after "answer (is)", else in parentheses, else opening the
    text ("B) ...", "C.")."""
    for pattern in CHOICE_PATTERNS:
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None


def regex_extractor(pattern: str) -> Callable[[str], str | None]:
    """The first match's group 1 (the whole match when the pattern has no group)."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise UserError(f"bad answer regex {pattern!r}: {exc}") from None
    group = 1 if compiled.groups else 0

    def extract(text: str) -> str | None:
        found = compiled.search(text)
        return found.group(group) if found else None
    return extract


def extractor(spec: str | Callable[[str], str | None]) -> Callable[[str], str | None]:
    """An answer extractor from its name: 'first-line', 'last-number', 'choice' (a letter A-E),
    'regex:PATTERN'; a callable (text -> answer or None) is used as it is."""
    if callable(spec):
        return spec
    named = {"first-line": first_line, "last-number": last_number, "choice": choice_letter}
    if isinstance(spec, str) and spec in named:
        return named[spec]
    if isinstance(spec, str) and spec.startswith("regex:"):
        return regex_extractor(spec[len("regex:"):])
    raise UserError(f"unknown answer extractor {spec!r}; valid: {', '.join(EXTRACTORS)} "
                    f"or a callable")


def normalise(answer: str) -> str | None:
    """Casefolded, punctuation dropped, whitespace collapsed, numbers in one form ('7.0', '+7'
    and '7.' -> '7'; '1,000' -> '1000'); None when nothing is left."""
    parts, start = [], 0
    for number in NUMBER.finditer(answer):
        parts += [_drop_punctuation(answer[start:number.start()]),
                  _canonical_number(number.group())]
        start = number.end()
    parts.append(_drop_punctuation(answer[start:]))
    return " ".join(" ".join(parts).casefold().split()) or None


def _drop_punctuation(text: str) -> str:
    return "".join(" " if unicodedata.category(char).startswith("P") else char for char in text)


def _canonical_number(text: str) -> str:
    canonical = format(Decimal(text.replace(",", "")).normalize(), "f")
    return "0" if canonical == "-0" else canonical


# ---- the vote -------------------------------------------------------------------------------

@dataclass
class Cluster:
    """Answers counted as one: equal after normalisation, or merged by semantic similarity."""
    answer: str            # its most voted answer (a tie: the one that arrived first)
    votes: int
    first: int             # arrival index of its first vote (ties between clusters go to it)
    members: list[str]     # its distinct answers, most voted first


def tally(answers: list[str | None], similarity: Callable[[list[str]], torch.Tensor] | None = None,
          threshold: float = 0.9) -> list[Cluster]:
    """Clusters of the answers (None: a sample without one, not counted), most votes first, then
    first arrival. `similarity(distinct answers) -> [n, n]` cosines: answers at or above
    `threshold` are connected, and each connected group is one cluster (so the clusters do not
    depend on the order of arrival, and answers arriving later only ever merge clusters);
    answers with a digit are left out of merging."""
    counts = Counter(answer for answer in answers if answer is not None)
    first = {}
    for index, answer in enumerate(answers):
        if answer is not None:
            first.setdefault(answer, index)
    distinct = list(first)
    root = list(range(len(distinct)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    words = [i for i, answer in enumerate(distinct) if not any(char.isdigit() for char in answer)]
    if similarity is not None and len(words) > 1:
        scores = similarity([distinct[i] for i in words]).tolist()
        for a, i in enumerate(words):
            for b in range(a + 1, len(words)):
                if scores[a][b] >= threshold:
                    root[find(words[b])] = find(i)
    groups: dict[int, list[str]] = {}
    for i, answer in enumerate(distinct):
        groups.setdefault(find(i), []).append(answer)
    clusters = []
    for members in groups.values():
        members.sort(key=lambda answer: (-counts[answer], first[answer]))
        clusters.append(Cluster(members[0], sum(counts[answer] for answer in members),
                                min(first[answer] for answer in members), members))
    return sorted(clusters, key=lambda cluster: (-cluster.votes, cluster.first))


def leader_probability(counts: list[int]) -> float:
    """The posterior probability that the first answer is the most likely one, given each
    answer's vote count, under a Dirichlet(counts + 1) posterior (a uniform prior), computed
    exactly: with independent G_i ~ Gamma(counts_i + 1), it is P(G_0 > G_j for every j) =
    integral over x of the density of G_0 times the CDFs of the others, whose integer shapes
    make the integrand a sum of terms c x^n e^(-r x), each integrating to c n! / r^(n+1).
    Two answers: P(Beta(a + 1, b + 1) > 1/2)."""
    leader, *others = (count + 1 for count in counts)
    terms = {(leader - 1, 1): Fraction(1, factorial(leader - 1))}   # (power of x, rate) -> coef
    for shape in others:   # times the CDF 1 - e^(-x) sum_{i < shape} x^i / i!
        product = dict(terms)
        for (power, rate), coefficient in terms.items():
            for i in range(shape):
                key = (power + i, rate + 1)
                product[key] = product.get(key, 0) - coefficient / factorial(i)
        terms = product
    return float(sum(coefficient * Fraction(factorial(power), rate ** (power + 1))
                     for (power, rate), coefficient in terms.items()))


@dataclass(frozen=True)
class VoteOptions:
    """How answers are extracted, merged and voted on.

    `extract`: see `extractor`. `embed(texts) -> [n, dim]` tensor (e.g. `minilm_embed()`): with
    it, answers of cosine >= `threshold` are one cluster. `early_stop`: 'overtake' stops once
    the leader cannot be overtaken by the samples still to come (the vote is then the one all
    k samples would give); 'adaptive' also stops by Adaptive-Consistency's criterion (Aggarwal
    et al. 2023, "Let's Sample Step by Step: Adaptive-Consistency for Efficient Reasoning and
    Coding with LLMs"): the posterior probability that the leader is the majority answer
    (`leader_probability`) reaches `confidence`, over the top two clusters ('beta', the paper's
    default) or all of them ('dirichlet'); 'off' waits for every sample.

    `draw`: 'all' (default) draws the k at once (one prefill) and cancels the rows still
    running once the vote is decided (rows run in lockstep, so that saves few tokens but no
    time is lost); 'waves', with an early stop, draws the fewest samples that could decide the
    vote (4 of 7 when they all agree), then again as many as could decide it from there, each
    wave a group whose prompt K/V come from the prefix cache: a decided vote leaves samples
    undrawn (fewer tokens), at the price of a wave's latency when it is not decided.
    `router`: for consistency='auto', a `ComplexityRouter` or its JSON file (default: the one
    shipped for the artifact's checkpoint)."""
    extract: str | Callable[[str], str | None] = "first-line"
    embed: Callable[[list[str]], torch.Tensor] | None = None
    threshold: float = 0.9
    early_stop: str = "adaptive"
    confidence: float = 0.95
    criterion: str = "beta"
    draw: str = "all"
    router: object = None

    def __post_init__(self):
        extractor(self.extract)
        if not 0 < self.threshold <= 1:
            raise UserError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.early_stop not in EARLY_STOPS:
            raise UserError(f"unknown early_stop {self.early_stop!r}; valid: "
                            f"{', '.join(EARLY_STOPS)}")
        if not 0.5 < self.confidence <= 1:
            raise UserError(f"confidence must be in (0.5, 1], got {self.confidence}")
        if self.criterion not in CRITERIA:
            raise UserError(f"unknown criterion {self.criterion!r}; valid: {', '.join(CRITERIA)}")
        if self.draw not in DRAWS:
            raise UserError(f"unknown draw {self.draw!r}; valid: {', '.join(DRAWS)}")


@dataclass
class Vote:
    """A vote's outcome."""
    clusters: list[Cluster]       # most votes first
    answers: list[str | None]     # each counted sample's answer, in arrival order
    early: bool                   # decided before all samples arrived

    @property
    def answer(self) -> str | None:
        """The winning cluster's answer (None: no sample had an answer)."""
        return self.clusters[0].answer if self.clusters else None

    @property
    def votes(self) -> dict[str, int]:
        return {cluster.answer: cluster.votes for cluster in self.clusters}


class Voter:
    """Tallies the answers of `samples` expected samples one at a time, as they finish, and says
    when the vote is decided (see `VoteOptions.early_stop`). Ties between clusters go to the one
    whose first answer arrived first. Once decided, the vote is final."""

    def __init__(self, samples: int, options: VoteOptions = VoteOptions()):
        if samples < 1:
            raise UserError(f"a vote needs at least 1 sample, got {samples}")
        self.samples, self.options = samples, options
        self.extract = extractor(options.extract)
        self.answers: list[str | None] = []
        self.clusters: list[Cluster] = []
        self.decided = False
        self.embeddings: dict[str, torch.Tensor] = {}   # each distinct answer embedded once
        self.compared: tuple[tuple[str, ...], torch.Tensor] | None = None   # the last cosines

    def answer(self, text: str) -> str | None:
        """The normalised answer extracted from a sample's text."""
        extracted = self.extract(text)
        return None if extracted is None else normalise(extracted)

    def add(self, text: str) -> bool:
        """Count one finished sample's text; True once the vote is decided."""
        if self.decided:
            raise RuntimeError("the vote is already decided")
        self.answers.append(self.answer(text))
        similarity = self._similarity if self.options.embed is not None else None
        self.clusters = tally(self.answers, similarity, self.options.threshold)
        self.decided = self._decides(0)
        return self.decided

    def needed(self) -> int:
        """The fewest further samples that could decide the vote (all agreeing with the leader,
        or with a first answer when there is none yet): what a wave draws."""
        remaining = self.samples - len(self.answers)
        return next((m for m in range(1, remaining) if self._decides(m)), remaining)

    def vote(self) -> Vote:
        return Vote(self.clusters, list(self.answers), early=len(self.answers) < self.samples)

    def _decides(self, more: int) -> bool:
        """Whether the vote is decided once `more` further answers all join the leader (0: now)."""
        remaining = self.samples - len(self.answers) - more
        if remaining == 0:
            return True
        stop = self.options.early_stop
        if stop == "off" or not (self.clusters or more):
            return False
        if self.clusters:
            leader, rivals = self.clusters[0], self.clusters[1:]
            votes, first = leader.votes + more, leader.first
        else:
            votes, first, rivals = more, len(self.answers), []
        return (self._safe(votes, first, rivals, remaining)
                or (stop == "adaptive" and self._confident([votes] + [c.votes for c in rivals])))

    def _safe(self, votes: int, first: int, rivals: list[Cluster], remaining: int) -> bool:
        """The leader (`votes`, first arrival `first`) keeps the lead whatever the remaining
        samples answer. Without merging, the strongest rival is the runner-up; with it, answers
        still to come may connect every other cluster into one, so the rival is all of them
        together."""
        if self.options.embed is not None:
            rival_votes = sum(cluster.votes for cluster in rivals)
            rival_first = min((cluster.first for cluster in rivals), default=self.samples)
        else:
            rival_votes, rival_first = ((rivals[0].votes, rivals[0].first) if rivals
                                        else (0, self.samples))
        best = rival_votes + remaining   # a new answer arrives after the leader's first vote
        return votes > best or (votes == best and first < rival_first)

    def _confident(self, counts: list[int]) -> bool:
        counts = counts if len(counts) > 1 else counts + [0]
        if self.options.criterion == "beta":
            counts = counts[:2]
        return leader_probability(counts) >= self.options.confidence

    def _similarity(self, answers: list[str]) -> torch.Tensor:
        """Cosines of `answers`, recomputed only when a new distinct answer has arrived."""
        if self.compared is None or self.compared[0] != tuple(answers):
            new = [answer for answer in answers if answer not in self.embeddings]
            if new:
                vectors = torch.as_tensor(self.options.embed(new)).float().cpu()
                vectors = F.normalize(vectors, dim=-1)
                self.embeddings.update(zip(new, vectors))
            matrix = torch.stack([self.embeddings[answer] for answer in answers])
            # elementwise, not a matmul: a few rows are cheaper than waking BLAS threads
            self.compared = (tuple(answers), (matrix[:, None] * matrix[None]).sum(-1))
        return self.compared[1]


def majority_vote(texts: list[str], options: VoteOptions = VoteOptions()) -> Vote:
    """The vote over all of `texts` (in arrival order), without early stop."""
    voter = Voter(len(texts), replace(options, early_stop="off"))
    for text in texts:
        voter.add(text)
    return voter.vote()


def minilm_embed(encoder=None) -> Callable[[list[str]], torch.Tensor]:
    """`embed` for the semantic tie-break: the bundled minilm-l6 artifact (compiled here when
    `encoder` is None), mean-pooled and L2-normalised as the server's /v1/embeddings does."""
    from .quality import mean_pool

    if encoder is None:
        from .compiler import compile_model
        encoder = compile_model("minilm-l6")
    tokenizer = encoder.tokenizer

    def embed(texts: list[str]) -> torch.Tensor:
        batch = tokenizer(texts, padding=True, truncation=True, max_length=encoder.max_positions,
                          return_tensors="pt")
        hidden = encoder(batch["input_ids"], batch["attention_mask"])["last_hidden_state"]
        return mean_pool(hidden.float().cpu(), batch["attention_mask"])
    return embed


# ---- sampling on a shared prefix ----------------------------------------------------------------

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
                 lead=None, client: str | None = None, priority: int = 1):
        from .requests import EngineRequest

        if engine.decode is None:
            raise UserError("self-consistency needs the artifact's tokenizer (answers are "
                            "extracted from text)")
        self.engine, self.voter, self.texts, self.lead = engine, Voter(k, options), {}, lead
        self.voted: list[EngineRequest] = []   # in the order counted
        self.held: list[EngineRequest] = []    # finished before the lead, counted after it
        drawn = k - (lead is not None)
        self.seeds = [None if sampling.seed is None else sampling.seed + i for i in range(drawn)]
        self.requests = [EngineRequest(prompt, max_new_tokens, replace(sampling, seed=seed),
                                       list(stop or []), budget, priority, client=client,
                                       on_token=on_token, on_finish=self._finished,
                                       keep_first_logits=keep_first_logits)
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
    from .prefix_cache import PrefixCache

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
                             tier=getattr(group, "tier", None))
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
                        budget=budget, options=options)
    return _finish(engine, group, started)


class RoutedGroup:
    """`consistency='auto'` for one prompt on a `BatchEngine`: its greedy row joins the batch;
    when its prefill's first token arrives, the router (`ComplexityRouter`) reads the prompt
    and that prefill's logits and picks 1, 3 or 7 votes. 1: the greedy row's answer; 3 or 7:
    the greedy row goes on as the vote's first member (ties go to it) and a `SampleGroup` draws
    the other 2 or 6 as samples, whose prompt K/V come from the engine's prefix cache when it
    has one."""

    def __init__(self, engine, prompt: list[int], router, *, max_new_tokens: int,
                 sampling: SamplingConfig, stop: list[str] | None = None,
                 budget: float | None = None, options: VoteOptions = VoteOptions(),
                 client: str | None = None, priority: int = 1):
        _check_samples(max(router.tiers), sampling)
        self.engine, self.prompt, self.router, self.tier = engine, prompt, router, None
        self.features: list[float] | None = None
        self.options = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                            budget=budget, options=options, client=client, priority=priority)
        self.greedy = SampleGroup(engine, prompt, 1, **{**self.options, "sampling": replace(
            sampling, do_sample=False)}, on_token=self._route, keep_first_logits=True)
        self.group = self.greedy

    def _route(self, token: int) -> None:
        if self.tier is not None:
            return
        from .consistency_router import prompt_features

        self.features = prompt_features(self.engine.decode(self.prompt),
                                        self.greedy.requests[0].first_logits)
        self.tier = self.router.tier(self.features)
        if self.tier > 1:
            self.group = SampleGroup(self.engine, self.prompt, self.tier, **self.options,
                                     lead=self.greedy.requests[0])

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
    if consistency == "auto":
        from .consistency_router import find_router

        return RoutedGroup(engine, prompt, find_router(compiled, options.router), options=options,
                           **sample_options)
    _check_samples(consistency, sample_options["sampling"])
    return SampleGroup(engine, prompt, consistency, options=options, **sample_options)


def generate_voted(compiled, input_ids, attention_mask, consistency, *, vote: VoteOptions | None,
                   speculate: str, stream: bool, prefix_cache=None, **options) -> ConsistencyResult:
    """`CompiledModel.generate(..., consistency=k or 'auto')`: checks the options (one-line
    errors), then the vote on the one prompt with an engine of its own (and a prefix cache,
    so waves and 'auto''s samples reuse the prompt's K/V); `options` are SampleGroup's."""
    from .generation import _check_prompts

    check_vote(consistency, speculate=speculate, stream=stream, sampling=options["sampling"])
    prompt_ids, pads = _check_prompts(input_ids, attention_mask)
    if prompt_ids.shape[0] != 1:
        raise UserError(f"consistency votes over the samples of one prompt; got a batch of "
                        f"{prompt_ids.shape[0]}")
    started = perf_counter()
    engine = _engine(compiled, 7 if consistency == "auto" else max(consistency, 1), prefix_cache)
    prompt = [int(token) for token in prompt_ids[0, int(pads[0]):]]
    group = start_vote(compiled, engine, prompt, consistency, options=vote or VoteOptions(),
                       **options)
    return _finish(engine, group, started)
