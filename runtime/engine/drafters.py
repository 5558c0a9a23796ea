"""Drafters for speculative decoding: cheap guesses of the next tokens, verified by the full path.

`NGramDrafter` (prompt lookup): a hash index from the n-grams of the request's own tokens
(prompt and output so far) to where they last occurred; the draft is what followed that
occurrence. It costs a dict lookup per step and pays on input-grounded text (summaries,
quotes, code edits, extraction), where the output repeats spans of the prompt.

`LightDrafter` (self-speculation): the light path (a cheaper plan of the same artifact:
skipped MLPs for 'self', lower-precision weights for 'quant') drafts one token at a time on the
batch's own cache; its approximate K/V are overwritten by the verifying full step.

The engine's speculation (speculation.py) asks them per row and step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rbcompile.runtime.engine.sampling import SamplingConfig


class NGramDrafter:
    """Draft continuations of the longest recent n-gram (`max_n` down to `min_n` tokens) that
    occurred before in the row's tokens."""

    def __init__(self, tokens, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; index every n-gram that now has a token after it."""
        for token in tokens:
            end = len(self.tokens)  # n-grams ending here are followed by `token`
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._last_end[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def propose(self, k: int, min_n: int | None = None) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram (of at least `min_n` tokens, default the drafter's), copied with overlap
        (LZ77-style: a continuation that runs into the end of the tokens goes on with its own
        start, so a loop is drafted `k` tokens ahead); [] when no suffix occurred before."""
        shortest = self.min_n if min_n is None else max(min_n, self.min_n)
        for n in range(min(self.max_n, len(self.tokens)), shortest - 1, -1):
            end = self._last_end.get(tuple(self.tokens[-n:]))
            if end is not None:
                period = len(self.tokens) - end
                return [self.tokens[end + i % period] for i in range(k)]
        return []


@dataclass
class Proposal:
    """One row's drafts, and for sampled light-path drafts the distributions they were drawn
    from (none: each proposed with probability 1)."""
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


def draft_speedup(acceptance: float, cost: float, drafts: int) -> float:
    """Expected tokens per full step's time of drafting `drafts` tokens a step, each kept with
    probability `acceptance` while the ones before it were, at `cost` per draft forward next to
    a full step, with the verifying step costing one full step."""
    kept = sum(acceptance ** index for index in range(1, drafts + 1))
    return (1 + kept) / (drafts * cost + 1)


@dataclass(frozen=True)
class LightDrafter:
    """The light path as a drafter. `step`: the decoder step under the light plan's gates (the
    full step's interface); a row stops drafting when its top draft probability falls below
    `threshold` (adaptive draft length); `cost`: a light forward's cost next to a full one,
    which `auto` may lose before its first measurement (0 for a plan calibration measured to
    pay); `in_auto`: whether `auto` tries it (not when calibration found that no plan pays);
    `level`: the weight level a 'quant' drafter runs at."""
    step: Callable
    threshold: float = 0.5
    cost: float = 1.0
    in_auto: bool = True
    level: str | None = None

    def propose(self, forward: Callable, pending: list[int], limits: dict[int, int],
                samplings: list[SamplingConfig], generators: list) -> dict[int, Proposal]:
        """Drafts for the batch rows in `limits` (row -> most drafts), each following its
        `pending` token. `forward(tokens, offset)` runs the light step on one token per batch
        row, written `offset` slots past the cache's length: logits [rows, vocab]."""
        proposals = {row: Proposal() for row in limits}
        going = [row for row, limit in limits.items() if limit > 0]
        current, offset = list(pending), 0
        while going:
            logits = forward(current, offset)
            for row in list(going):
                sampling, proposal = samplings[row], proposals[row]
                distribution = (sampling.probabilities(logits[row])
                                if sampling.do_sample or self.threshold > 0 else None)
                if distribution is not None and distribution.max() < self.threshold:
                    going.remove(row)
                    continue
                if sampling.do_sample:
                    token = int(torch.multinomial(distribution, 1, generator=generators[row]))
                    proposal.probs.append(distribution)
                else:
                    token = int(logits[row].argmax())
                proposal.tokens.append(token)
                current[row] = token
                if len(proposal.tokens) == limits[row]:
                    going.remove(row)
            offset += 1
        return proposals

