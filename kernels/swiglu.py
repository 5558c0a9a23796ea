"""SwiGLU: `silu(gate) * up` (Llama MLP: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`).

Reference: transformers' LlamaMLP with `hidden_act="silu"`.
"""
import torch

from .registry import kernel_op


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


swiglu = kernel_op("swiglu", swiglu_reference)
