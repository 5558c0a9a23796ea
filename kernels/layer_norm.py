"""LayerNorm, and residual add + LayerNorm (post-LN BERT: `LayerNorm(x + residual)`; pre-LN
GPT-2: the add before `ln_2`). Returns the normalised output and the new residual.

Reference: torch.nn.functional.layer_norm over the last dimension, as BertSelfOutput /
GPT2Block call it.
"""
import torch

from .registry import kernel_op


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return layer_norm_reference(total, weight, bias, eps), total


layer_norm = kernel_op("layer_norm", layer_norm_reference)
add_layer_norm = kernel_op("add_layer_norm", add_layer_norm_reference)
