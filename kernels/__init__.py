"""Fused kernels (Triton on CUDA, PyTorch reference on CPU), one file each; importing this
package registers them as `torch.ops.rbcompile.*` (see registry.py)."""
from . import gated_residual, gelu, head_attention, layer_norm, rms_norm, swiglu  # noqa: F401
from .registry import DECOMPOSITIONS  # noqa: F401
