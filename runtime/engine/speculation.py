"""Speculative decoding in the batch engine's steps (engine.py).

Each step, every group of rows that drafts together (`DraftGroup`: one `generate` call's rows,
or one served choice) picks its drafter (draft_policy.py); n-gram rows propose by lookup over
their own tokens (`NGramDrafter`), light-path rows by the light step run over the batch on its
own cache (`LightDrafter`). The step verifies [pending token + drafts] of every row in one
forward, and each group hears what its rows kept and how long the step took.
"""
from __future__ import annotations

from typing import Callable

from rbcompile.errors import UserError
from rbcompile.runtime.engine.draft_policy import AutoPolicy, FixedPolicy
from rbcompile.runtime.engine.drafters import LightDrafter, NGramDrafter, Proposal
from rbcompile.runtime.engine.requests import (
    FIRST_DRAFT_LENGTH,
    SPECULATE_MODES,
    DraftGroup,
    EngineRequest,
)

# 'quant' rows copy an n-gram's continuation instead where the last this many tokens occurred
# before (a shorter match drafts worse than the lower level does)
QUANT_NGRAM_MIN = 2


# 'auto' drafts only while the batch runs at most this many rows: a draft widens the step for
# every row, and from 4 concurrent streams drafting lost to plain steps with every drafter
# (benchmarks/bench_drafting_load.py, docs/executor.md "Drafting under load")
AUTO_DRAFT_ROWS = 2


class Speculation:
    """The drafters of an engine's rows. `light`: the light path, for 'self' (and 'auto');
    `quant`: the decoder at a lower weight level, for 'quant' (and 'auto'); `draft_tokens`:
    most drafts per row and step."""

    def __init__(self, draft_tokens: int, light: LightDrafter | None = None,
                 quant: LightDrafter | None = None):
        self.draft_tokens, self.light, self.quant = draft_tokens, light, quant
        self.ngrams: dict[EngineRequest, NGramDrafter] = {}

    def drafter(self, mode: str) -> LightDrafter | None:
        """The forward-running drafter of `mode` ('self' or 'quant')."""
        return self.light if mode == "self" else self.quant

    def check(self, request: EngineRequest) -> None:
        """A one-line UserError for a drafter this engine does not have."""
        check_mode(request.speculate, self.light, self.quant)

    def start(self, request: EngineRequest) -> None:
        """`request` joins the queue: its draft group (its own unless it shares one) and, for
        lookup, the n-gram index of its prompt."""
        if request.drafting is None:
            request.drafting = DraftGroup(self.policy(request.speculate))
        if request.speculate in ("ngram", "quant", "auto"):
            self.ngrams[request] = NGramDrafter(request.prompt)

    def policy(self, speculate: str) -> FixedPolicy | AutoPolicy:
        """The policy of a group of rows asking `speculate`."""
        if speculate != "auto":
            return FixedPolicy(speculate)
        drafters = {mode: drafter for mode in ("self", "quant")
                     if (drafter := self.drafter(mode)) is not None and drafter.in_auto}
        # before its first step a drafter may lose what it adds to a plain step: nothing for
        # n-gram lookup, a first step's forwards of a forward-running drafter
        first = min(FIRST_DRAFT_LENGTH, self.draft_tokens)
        return AutoPolicy(["off", "ngram", *drafters],
                          {mode: first * drafter.cost for mode, drafter in drafters.items()})

    def extend(self, request: EngineRequest, token: int) -> None:
        if request in self.ngrams:
            self.ngrams[request].extend([token])

    def drop(self, request: EngineRequest) -> None:
        self.ngrams.pop(request, None)

    def propose(self, running: list[EngineRequest], limit: int, light_forward: Callable,
                generators: list) -> list[Proposal]:
        """Each running row's drafts this step (none in 'off', or without a match): at most
        `limit`, and one less than the tokens it has left. `light_forward(step, tokens,
        offset)`: a drafter's step over the batch (drafters.LightDrafter)."""
        groups = _groups(running)
        for group in groups:
            group.mode = "off" if _crowded(group, running) else group.policy.choose()
        proposals = [Proposal() for _ in running]
        forward_rows: dict[str, dict[int, int]] = {}   # mode -> row -> most drafts
        for index, request in enumerate(running):
            left = min(limit, request.draft_length,
                       request.max_new_tokens - len(request.tokens) - 1)
            mode = request.drafting.mode
            if left < 1 or mode == "off":
                continue
            if mode == "ngram":
                proposals[index].tokens = self.ngrams[request].propose(left)
            elif mode == "quant" and request in self.ngrams and \
                    (copied := self.ngrams[request].propose(left, QUANT_NGRAM_MIN)):
                proposals[index].tokens = copied   # a repeat: copying it costs no forward
            else:
                forward_rows.setdefault(mode, {})[index] = left
        for mode, rows in forward_rows.items():
            calls = []

            def counted(tokens, offset, step=self.drafter(mode).step):
                calls.append(offset)
                return light_forward(step, tokens, offset)

            drafted = self.drafter(mode).propose(counted, [r.tokens[-1] for r in running], rows,
                                                 [r.sampling for r in running], generators)
            for index, proposal in drafted.items():
                proposals[index] = proposal
            for group in _groups([running[index] for index in rows]):
                group.stats.forward_calls += len(calls)
        return proposals

    @staticmethod
    def prefilled(requests: list[EngineRequest]) -> None:
        """A prefill forward ran for `requests`: their groups count it."""
        for group, rows in _groups(requests).items():
            group.stats.forward_calls += 1
            group.stats.rows_per_step.append(rows)

    def record(self, running: list[EngineRequest], proposals: list[Proposal],
               emitted: list[list[int]], seconds: float) -> None:
        """After a decode step of `seconds`: each group's counters and policy hear how many
        drafts its rows verified and kept, and each row's draft length follows its acceptance
        (`next_draft_length`)."""
        counts: dict[DraftGroup, list[int]] = {}
        for request, proposal, tokens in zip(running, proposals, emitted):
            if proposal.tokens:
                request.draft_length = next_draft_length(
                    request.draft_length, len(proposal.tokens), len(tokens) - 1,
                    self.draft_tokens)
            count = counts.setdefault(request.drafting, [0, 0, 0])
            count[0] += 1
            count[1] += len(proposal.tokens)
            count[2] += len(tokens) - 1
        for group, (rows, drafted, kept) in counts.items():
            group.stats.forward_calls += 1
            group.stats.rows_per_step.append(rows)
            group.stats.record_step(group.mode, rows, drafted, kept)
            if not _crowded(group, running):
                group.policy.record(group.mode, 1 + kept / rows, seconds, drafted / rows,
                                    kept / rows)


def next_draft_length(length: int, drafted: int, kept: int, most: int) -> int:
    """A row's most drafts for its next step: twice as many (up to `most`) after a step that
    kept all of `length` drafts, one past the kept ones after a rejection, else the same."""
    if kept < drafted:
        return max(1, kept + 1)
    return min(most, 2 * length) if drafted >= length else length


def check_mode(speculate: str, light: LightDrafter | None, quant: LightDrafter | None) -> None:
    """A one-line UserError for an unknown mode, or one whose drafter is missing."""
    if speculate not in SPECULATE_MODES:
        raise UserError(f"unknown speculate={speculate!r}; valid: {', '.join(SPECULATE_MODES)}")
    if speculate == "self" and light is None:
        raise UserError("speculate='self' needs a draft_step (the light path)")
    if speculate == "quant" and quant is None:
        raise UserError("speculate='quant' needs the onnxruntime executor and a lower weight "
                        "level measured at compile that drafts faster than the level decoding")


def _crowded(group: DraftGroup, running: list[EngineRequest]) -> bool:
    """Whether `group` picks by measurement ('auto') in a batch too large for drafting to pay
    (AUTO_DRAFT_ROWS): it then takes plain steps, and its policy does not learn from them."""
    return isinstance(group.policy, AutoPolicy) and len(running) > AUTO_DRAFT_ROWS


def _groups(requests: list[EngineRequest]) -> dict[DraftGroup, int]:
    """The draft groups of `requests`, in order, with how many of them each holds."""
    groups: dict[DraftGroup, int] = {}
    for request in requests:
        groups[request.drafting] = groups.get(request.drafting, 0) + 1
    return groups
