"""Log probabilities of tokens (OpenAI's `logprobs`, `top_logprobs` and `echo`): the log-softmax
of the raw logits each token was chosen from, before penalties, temperature and sampling filters
(as vLLM reports them), with the most likely alternatives. Those are the full path's unless the
row ran a lighter plan or weight level (a budget, a tier, the controller), then that forward's.
An echoed prompt's are the full path's.

A generated token's come from the logits it was chosen from: the prefill's for the first, then
each decode step's at the token's position (with drafting, the verifying forward's, so they are
the same with or without a drafter). A prompt's come from one more forward over it
(`prompt_logprobs`), in chunks so that long prompts do not hold [tokens, vocab] at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MAX_TOP_LOGPROBS = 20
PROMPT_CHUNK = 256   # prompt tokens scored per forward


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log probability and the `top` most likely tokens with theirs (most likely
    first)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Token i's log probability under logits[i] ([positions >= len(tokens), vocab]), with the
    `top` most likely alternatives."""
    if not tokens:
        return []
    scores = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = scores[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best = [((), ())] * len(tokens)
    if top:
        values, indices = scores.topk(top, dim=-1)
        best = zip(indices.tolist(), values.tolist())
    return [TokenLogprob(token, logprob, tuple(zip(ids, values)))
            for token, logprob, (ids, values) in zip(tokens, chosen, best)]


def record(request, logits: torch.Tensor, tokens: list[int]) -> None:
    """Keep `request`'s logprobs of `tokens` chosen from `logits` (`EngineRequest.logprobs`:
    how many alternatives; None: none kept)."""
    if request.logprobs is not None:
        request.token_logprobs.extend(logprobs_of(logits, tokens, request.logprobs))


def prompt_logprobs(step: Callable, shape, prompt: list[int],
                    top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log probability given the tokens before it (None for the first),
    from forwards of `step` (the decoder, full path) over the prompt into a scratch cache."""
    scored: list[TokenLogprob | None] = [None]
    cache: list[torch.Tensor] = []   # the chunks before, [1, kv heads, slots, head dim]
    with torch.no_grad():
        for start in range(0, len(prompt) - 1, PROMPT_CHUNK):
            end = min(len(prompt) - 1, start + PROMPT_CHUNK)   # the last token predicts none
            slots = torch.arange(start, end, device=shape.device)
            grown = torch.zeros(1, shape.kv_heads, end - start, shape.head_dim,
                                dtype=shape.dtype, device=shape.device)
            cache = [torch.cat([tensor, grown], 2) if cache else grown.clone()
                     for tensor in cache or [None] * (2 * shape.layers)]   # contiguous
            logits = step(torch.tensor([prompt[start:end]], device=shape.device),
                          torch.ones(1, end, dtype=torch.long, device=shape.device), slots[None],
                          slots, slots - start, cache)[0]
            scored += logprobs_of(logits, prompt[start + 1:end + 1], top)
    return scored
