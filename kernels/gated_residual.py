"""Gated residual `h + g * f(h)` for guarded branches: `gate` is a scalar or one value per row
([batch]), so rows of one batch can take or skip a branch without leaving the batch.

Reference: the residual add of a pre-LN block, `hidden = residual + branch(hidden)`, scaled.
"""
import torch

from .registry import kernel_op


def gated_residual_reference(h: torch.Tensor, f: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    g = gate.to(h.dtype)
    if g.dim() == 1:
        g = g.view(-1, *([1] * (h.dim() - 1)))
    return h + g * f


gated_residual = kernel_op("gated_residual", gated_residual_reference)
