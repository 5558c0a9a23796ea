"""Penalties and biases on a row's logits before a token is chosen (the OpenAI API's
`presence_penalty`, `frequency_penalty` and `logit_bias`, vLLM's `repetition_penalty`), with
vLLM's semantics: the repetition penalty covers every token seen (prompt and output: a positive
logit divided by it, a negative one multiplied), the presence and frequency penalties the
output's tokens only (minus `presence` once a token occurred, minus `frequency` per occurrence),
the bias is added last.

A decode step that verifies drafts sees logits at several positions of one row; position j's
are penalized as if drafts before j had been emitted, so the token chosen there is the one the
row would choose without drafting: penalties stay exact with every drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rbcompile.errors import UserError


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)

    def __post_init__(self):
        if not self.repetition > 0:
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1 or self.bias)


def penalize(penalties: Penalties | None, logits: torch.Tensor, prompt: list[int],
             output: list[int], drafts: list[int] = ()) -> torch.Tensor:
    """`logits` [positions, vocab] of one row, penalized: position j as if `output` and then
    `drafts[:j]` had been emitted after `prompt` (unchanged without active penalties)."""
    if penalties is None or not penalties.active:
        return logits
    logits = logits.float().clone()
    device, vocab = logits.device, logits.shape[-1]
    counts = torch.zeros(vocab, device=device)
    if output:
        counts.index_add_(0, torch.tensor(output, device=device), torch.ones(len(output), device=device))
    in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
    in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True
    bias = torch.zeros(vocab, device=device)
    for token, value in penalties.bias:
        bias[token] += value
    for position in range(logits.shape[0]):
        if position:
            counts[drafts[position - 1]] += 1
        row, seen = logits[position], counts > 0
        if penalties.repetition != 1:
            repeated = seen | in_prompt
            row = torch.where(repeated & (row > 0), row / penalties.repetition,
                              torch.where(repeated, row * penalties.repetition, row))
        logits[position] = row - penalties.frequency * counts - penalties.presence * seen + bias
    return logits
