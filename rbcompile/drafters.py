"""Drafters for speculative decoding: cheap guesses of the next tokens, verified by the full path.

`NGramDrafter` (prompt lookup): a hash index from the n-grams of the request's own tokens
(prompt and output so far) to where they last occurred; the draft is what followed that
occurrence. It costs a dict lookup per step and pays on input-grounded text (summaries,
quotes, code edits, extraction), where the output repeats spans of the prompt.

`generate`'s proposers (generation.py asks one per step for every row of its batch):
`NGramProposer` (an `NGramDrafter` per row) and `SelfDrafter` (the light path on the same
cache). The batch engine asks `NGramDrafter` per row directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingConfig


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

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        n-gram, copied with overlap (LZ77-style: a continuation that runs into the end of the
        tokens goes on with its own start, so a loop is drafted `k` tokens ahead); [] when no
        suffix occurred before."""
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            end = self._last_end.get(tuple(self.tokens[-n:]))
            if end is not None:
                period = len(self.tokens) - end
                return [self.tokens[end + i % period] for i in range(k)]
        return []


@dataclass
class Drafts:
    """The same number of draft tokens for every row, and the distributions they were drawn
    from (None: each proposed with probability 1)."""
    tokens: torch.Tensor                 # [B, k]
    probs: torch.Tensor | None = None    # [B, k, vocab]


class Drafter:
    """Proposes up to `limit` tokens following each row's pending token, or None."""

    def propose(self, pending: torch.Tensor, limit: int) -> Drafts | None:
        raise NotImplementedError

    def observe(self, emitted: list[list[int]]) -> None:
        """The tokens each row emitted this step."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only batch rows `rows` go on."""


class NGramProposer(Drafter):
    """Prompt lookup per row (`NGramDrafter`). A step verifies as many drafts as the longest
    proposal has; shorter ones (or none) are filled with the row's pending token, drafts like
    any other that the full path keeps only where it agrees (so filling is lossless)."""

    def __init__(self, prompts: list[list[int]]):
        self.drafters = [NGramDrafter(prompt) for prompt in prompts]

    def propose(self, pending, limit):
        proposals = [drafter.propose(limit) for drafter in self.drafters]
        length = max(len(proposal) for proposal in proposals)
        if not length:
            return None
        filled = [proposal + [token] * (length - len(proposal))
                  for proposal, token in zip(proposals, pending.tolist())]
        return Drafts(torch.tensor(filled, device=pending.device))

    def observe(self, emitted):
        for drafter, tokens in zip(self.drafters, emitted):
            drafter.extend(tokens)

    def keep_rows(self, rows):
        self.drafters = [self.drafters[row] for row in rows]


class SelfDrafter(Drafter):
    """Self-speculation: the light path drafts one token at a time on the same cache (its
    approximate K/V are overwritten by the verifying full step), and stops when any row's top
    draft probability falls below `threshold` (adaptive draft length)."""

    def __init__(self, runner, sampling: SamplingConfig, generator, threshold: float):
        """`runner`: generation.ModelRunner, whose `forward(..., light=True)` drafts."""
        self.runner, self.sampling, self.generator, self.threshold = runner, sampling, generator, threshold

    def propose(self, pending, limit):
        tokens, probs = [], []
        current = pending[:, None]
        for offset in range(limit):
            logits = self.runner.forward(current, offset, light=True)[:, -1]
            distribution = self.sampling.probabilities(logits)
            if distribution.max(-1).values.min() < self.threshold:
                break
            if self.sampling.do_sample:
                draft = torch.multinomial(distribution, 1, generator=self.generator).squeeze(-1)
            else:
                draft = logits.argmax(-1)
            tokens.append(draft)
            probs.append(distribution)
            current = draft[:, None]
        if not tokens:
            return None
        return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if self.sampling.do_sample else None)
