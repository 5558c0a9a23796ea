"""Input-complexity score in [0, 1], far cheaper than the model: it reads only token ids.

score = 0.5 * length term + 0.5 * rare-token density. Length term: real tokens / `long_input`
(capped at 1). Rare tokens: ids in the upper half of the vocabulary; BPE and WordPiece
vocabularies add rarer pieces later, so a high id is a cheap proxy for terminology and rare words.
"""
from __future__ import annotations

import torch


class LengthRarityComplexity:
    def __init__(self, vocab_size: int, long_input: int = 256):
        self.rare_from = vocab_size // 2
        self.long_input = long_input

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Per-sample scores, shape [batch]."""
        real = attention_mask.bool()
        lengths = real.sum(dim=1).clamp(min=1)
        length_term = (lengths.float() / self.long_input).clamp(max=1.0)
        rare = ((input_ids >= self.rare_from) & real).sum(dim=1).float() / lengths
        return 0.5 * length_term + 0.5 * rare
