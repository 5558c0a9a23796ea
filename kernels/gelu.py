"""GELU with bias: `gelu(x + bias)`, erf form (BERT, "gelu") or tanh form (GPT-2, "gelu_new").

Reference: torch.nn.functional.gelu(approximate="none" | "tanh"); transformers' NewGELUActivation
is the tanh formula.
"""
from typing import Optional

import torch

from .registry import kernel_op


def gelu_bias_reference(x: torch.Tensor, bias: Optional[torch.Tensor],
                        approximate: str) -> torch.Tensor:
    return torch.nn.functional.gelu(x if bias is None else x + bias, approximate=approximate)


gelu_bias = kernel_op("gelu_bias", gelu_bias_reference)
