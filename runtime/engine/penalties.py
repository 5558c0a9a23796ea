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

import numpy as np
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
    `drafts[:j]` had been emitted after `prompt` (unchanged without active penalties). In
    numpy: small torch ops wait on their thread pool behind onnxruntime's spinning workers
    (docs/serving.md has the measurement)."""
    if penalties is None or not penalties.active:
        return logits
    scores = logits.float().cpu().numpy().copy()
    vocab = scores.shape[-1]
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab]
    counts = counts.astype(np.float32)
    in_prompt = np.zeros(vocab, dtype=bool)
    in_prompt[np.asarray(prompt, dtype=np.int64)] = True
    bias = np.zeros(vocab, dtype=np.float32)
    for token, value in penalties.bias:
        bias[token] += value
    for position in range(scores.shape[0]):
        if position:
            counts[drafts[position - 1]] += 1
        row, seen = scores[position], counts > 0
        if penalties.repetition != 1:
            repeated = seen | in_prompt
            row = np.where(repeated & (row > 0), row / penalties.repetition,
                           np.where(repeated, row * penalties.repetition, row))
        scores[position] = row - penalties.frequency * counts - penalties.presence * seen + bias
    return torch.from_numpy(scores).to(logits.device)
