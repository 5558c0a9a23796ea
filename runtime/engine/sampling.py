"""Next-token choice: greedy, or sampling with temperature / top-k / top-p, and the speculative
acceptance rule that keeps sampled outputs distributed exactly as the full model's.

`SamplingConfig.probabilities(logits)` applies the filters in transformers' order (temperature,
then top-k, then top-p) and returns the distribution tokens are drawn from; greedy decoding
takes the argmax of the raw logits. `verify` checks a row's drafted tokens against the full
path's distributions (Leviathan et al. 2023, Chen et al. 2023): draft token x with draft
probability q(x) is kept with probability min(1, p(x) / q(x)); at the first rejection the token
is drawn from max(0, p - q), renormalised; when every draft is kept, one more token is drawn
from the last position's p. Drafters that propose one token deterministically (n-gram lookup)
have q = one-hot. Greedy verification keeps drafts while they equal the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rbcompile.errors import UserError
from rbcompile.runtime.engine.penalties import Penalties


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float | None = None      # drop tokens under min_p x the likeliest one's probability
    penalties: Penalties | None = None   # applied to the logits first (penalties.py)

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise UserError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1, got {self.top_k}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")

    def generator(self, device) -> torch.Generator | None:
        """A generator seeded with `seed` (None: torch's global one); any integer, taken modulo
        2**64 (torch's range; a negative seed means what torch makes of it)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed % 2**64)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., vocab] logits -> the filtered distribution sampling draws from (fp32)."""
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p   # the low tail holding <= 1 - top_p
            drop[..., -1] = False                 # the most likely token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probabilities = scores.softmax(-1)
        if self.min_p:
            floor = self.min_p * probabilities.max(-1, keepdim=True).values
            probabilities = probabilities.masked_fill(probabilities < floor, 0)
            probabilities = probabilities / probabilities.sum(-1, keepdim=True)
        return probabilities

    def choose(self, logits: torch.Tensor, generator=None) -> torch.Tensor:
        """One token per row of [rows, vocab] logits."""
        if not self.do_sample:
            return logits.argmax(-1)
        return torch.multinomial(self.probabilities(logits), 1, generator=generator).squeeze(-1)


def verify_rows(logits: torch.Tensor, configs: list[SamplingConfig], drafts: list[list[int]],
                generators: list, draft_probs: list[list[torch.Tensor]] | None = None,
                adjusters: list[Callable | None] | None = None) -> list[list[int]]:
    """Each row's tokens from one batch step's logits [rows, width, vocab]: the drafts the full
    path keeps and the token after them (`verify`); a row without drafts, a token from its
    first position. `draft_probs`: per row, the distributions its drafts were drawn from ([]:
    each proposed with probability 1); `adjusters`: per row, None or what turns its logits
    [positions, vocab] and drafts into the scores it chooses from (`EngineRequest.scores`:
    penalties, a grammar)."""
    greedy = logits[:, 0].argmax(-1).tolist()
    emitted = []
    for index, (config, draft, generator) in enumerate(zip(configs, drafts, generators)):
        scores = logits[index, :len(draft) + 1]   # the step's logits stay raw (logprobs)
        if adjusters and adjusters[index] is not None:
            scores = adjusters[index](scores, draft)
            greedy[index] = int(scores[0].argmax())
        if draft:
            probs = draft_probs[index] if draft_probs else []
            kept, following = verify(config, scores, torch.tensor(draft, device=logits.device),
                                     torch.stack(probs) if probs else None, generator)
            emitted.append(draft[:kept] + [following])
        elif config.do_sample:
            emitted.append([int(config.choose(scores[:1], generator))])
        else:
            emitted.append([greedy[index]])
    return emitted


def verify(config: SamplingConfig, logits: torch.Tensor, drafts: torch.Tensor,
           draft_probs: torch.Tensor | None = None, generator=None) -> tuple[int, int]:
    """(number of drafts kept, the token that follows them) for one row.

    `logits` [k + 1, vocab]: the full path's logits at the position before each draft and after
    the last; `drafts` [k]; `draft_probs` [k, vocab] the drafter's distributions (None: each
    draft was proposed with probability 1)."""
    k = drafts.shape[0]
    if not config.do_sample:
        best = logits.argmax(-1)
        matches = (best[:k] == drafts).long()
        kept = int(matches.cumprod(0).sum()) if k else 0
        return kept, int(best[kept])
    target = config.probabilities(logits)
    for i in range(k):
        token = int(drafts[i])
        p = target[i, token]
        q = draft_probs[i, token] if draft_probs is not None else torch.ones((), device=p.device)
        accept = torch.rand((), generator=generator, device=p.device) * q <= p
        if not accept:
            residual = target[i].clone()
            if draft_probs is None:
                residual[token] = 0
            else:
                residual = (residual - draft_probs[i]).clamp_min(0)
            if residual.sum() <= 0:  # p == q: nothing left to correct; draw from p
                residual = target[i]
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(target[k], 1, generator=generator))
