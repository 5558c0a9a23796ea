"""Self-consistency's vote: k sampled answers to one prompt, extracted, normalised and voted on
(Wang et al. 2023, "Self-Consistency Improves Chain of Thought Reasoning in Language Models"),
with a semantic tie-break and an adaptive early stop. The samples themselves are drawn on the
batch engine by vote_sampling.py.

A finished sample's text goes to the `Voter` (extract -> normalise -> tally into clusters),
which says when the vote is decided. With an `embed` callable, answers whose embeddings have a
cosine at or above a threshold are merged into one cluster before counting (near-duplicates:
"paris" and "paris france"); answers with a digit are only compared exactly (an embedding
finds "7" and "8" alike).
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction
from math import factorial
from typing import Callable

import torch
import torch.nn.functional as F

from rbcompile.artifact.manifest import PRECISION_LEVELS
from rbcompile.artifact.quality import mean_pool
from rbcompile.errors import UserError

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

    `extract`: see `extractor`. `embed(texts) -> [n, dim]` tensor (e.g. `minilm_embed(encoder)`): with
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
    shipped for the artifact's checkpoint).

    `tier_weights`: the weight level a vote of k samples decodes at, per k (e.g. {1: 'int4',
    3: 'fp32', 7: 'int8'}; a k not given: the decoder's level), or 'auto': per k, the level
    compile measured fastest at k rows within the quality guard (`executors.fastest_level`).
    A level the guard refuses is a one-line error when the vote starts."""
    extract: str | Callable[[str], str | None] = "first-line"
    embed: Callable[[list[str]], torch.Tensor] | None = None
    threshold: float = 0.9
    early_stop: str = "adaptive"
    confidence: float = 0.95
    criterion: str = "beta"
    draw: str = "all"
    router: object = None
    tier_weights: dict[int, str] | str | None = None

    def __post_init__(self):
        extractor(self.extract)
        check_tier_weights(self.tier_weights)
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


def check_tier_weights(tier_weights) -> None:
    """A one-line UserError for `VoteOptions.tier_weights` that are not 'auto', None or a
    mapping of sample counts (CONSISTENCY_SAMPLES) to level names."""
    if tier_weights is None or tier_weights == "auto":
        return
    if not isinstance(tier_weights, dict) or not all(
            k in CONSISTENCY_SAMPLES and isinstance(level, str)
            for k, level in tier_weights.items()):
        raise UserError(f"tier_weights must be 'auto' or map samples "
                        f"({', '.join(map(str, CONSISTENCY_SAMPLES))}) to weight levels, got "
                        f"{tier_weights!r}")


def parse_tier_weights(text: str) -> dict[int, str] | str:
    """`tier_weights` as written on a command line: 'auto', or K=LEVEL pairs
    ('1=int4,3=fp32,7=int8'); a one-line UserError otherwise."""
    if text == "auto":
        return text
    levels = ("fp32", *PRECISION_LEVELS)
    pairs = [part.partition("=") for part in text.split(",")]
    if not all(sep and k.strip() in map(str, CONSISTENCY_SAMPLES) and level.strip() in levels
               for k, sep, level in pairs):
        raise UserError(f"expected 'auto' or K=LEVEL pairs with K in "
                        f"{', '.join(map(str, CONSISTENCY_SAMPLES))} and LEVEL in "
                        f"{', '.join(levels)} (1=int4,3=fp32), got {text!r}")
    return {int(k): level.strip() for k, _, level in pairs}


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


def minilm_embed(encoder) -> Callable[[list[str]], torch.Tensor]:
    """`embed` for the semantic tie-break: an encoder artifact (the bundled one:
    `rbcompile.compile("minilm-l6")`), mean-pooled and L2-normalised as the server's
    /v1/embeddings does."""

    tokenizer = encoder.tokenizer

    def embed(texts: list[str]) -> torch.Tensor:
        batch = tokenizer(texts, padding=True, truncation=True, max_length=encoder.max_positions,
                          return_tensors="pt")
        hidden = encoder(batch["input_ids"], batch["attention_mask"])["last_hidden_state"]
        return mean_pool(hidden.float().cpu(), batch["attention_mask"])
    return embed
