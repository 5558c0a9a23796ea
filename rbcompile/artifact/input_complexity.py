"""The cheap input-complexity score from token ids alone (length and rare tokens): what
`CompiledModel.complexity_threshold` reads; runtime/control/complexity.py adds the early-layer term."""
from __future__ import annotations

import torch


class LengthRarityComplexity:
    """The cheap terms, from token ids only."""

    def __init__(self, vocab_size: int, long_input: int = 256):
        self.rare_from = vocab_size // 2
        self.long_input = long_input

    def terms(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        real = attention_mask.bool()
        lengths = real.sum(dim=1).clamp(min=1)
        length_term = (lengths.float() / self.long_input).clamp(max=1.0)
        rare = ((input_ids >= self.rare_from) & real).sum(dim=1).float() / lengths
        return length_term, rare

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per-sample scores, shape [batch]: the mean of the two terms."""
        length_term, rare = self.terms(input_ids, attention_mask)
        return 0.5 * length_term + 0.5 * rare
