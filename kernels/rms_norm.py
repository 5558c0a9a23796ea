"""RMSNorm, and residual add + RMSNorm (returns the normalised output and the new residual).

Reference: transformers' LlamaRMSNorm (models/llama/modeling_llama.py): normalise in fp32,
cast back to the input dtype, then scale by the weight.
"""
import torch

from .registry import kernel_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = residual + x
    return rms_norm_reference(total, weight, eps), total


rms_norm = kernel_op("rms_norm", rms_norm_reference)
add_rms_norm = kernel_op("add_rms_norm", add_rms_norm_reference)
