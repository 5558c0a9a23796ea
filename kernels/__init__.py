"""Fused kernels (Triton on CUDA, PyTorch reference on CPU), one file each; importing this
package registers them as `torch.ops.rbcompile.*` (see registry.py)."""
import torch

from rbcompile.kernels import (
           gated_residual,
           gelu,
           layer_norm,
           rms_norm,
           rotary,
           rotary_write_kv,
           swiglu,
           write_kv,
)
from rbcompile.kernels.registry import REFERENCES

OPS = torch.ops.rbcompile  # the registered kernels: OPS.rms_norm.default, ...

__all__ = ["OPS", "REFERENCES", "gated_residual", "gelu", "layer_norm", "rms_norm", "rotary",
           "rotary_write_kv", "swiglu", "write_kv"]
