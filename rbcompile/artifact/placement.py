"""Where and in which precision a compiled model runs: device and dtype names, checks, tolerances.

The dtype is chosen when a model is compiled: the graph is traced in that dtype, so it keeps the
casts the model makes in it (HF RMSNorm computes in fp32 inside a bf16 model; softmax may upcast;
mask fill values depend on the dtype). A graph traced in fp32 has no such casts, so it is never
run in another float dtype: recompile instead (`compile --dtype bf16`). The device is free: an
artifact runs wherever its weights are moved.
"""
from __future__ import annotations

import torch

from rbcompile.errors import UserError

DTYPES = {"fp32": torch.float32, "float32": torch.float32,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}

# Parity of the full path against eager transformers in the same dtype (max abs diff of an
# output, relative to that output's largest |value|, plus this absolute term). fp32 is exact up
# to reduction order; bf16 / fp16 differ by a few ulps wherever the kernels differ (padding to a
# CUDA-graph bucket changes the matmul shapes; fused kernels round once instead of per op).
TOLERANCE = {torch.float32: (0.0, 1e-5), torch.bfloat16: (2e-2, 2e-2),
             torch.float16: (5e-3, 5e-3)}


def parse_dtype(value) -> torch.dtype | None:
    """None, a torch float dtype, or a name (fp32 / bf16 / fp16 and torch's long names)."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in TOLERANCE:
            raise UserError(f"unsupported dtype {value}; use one of fp32, bf16, fp16")
        return value
    dtype = DTYPES.get(str(value).lower().replace("torch.", ""))
    if dtype is None:
        raise UserError(f"unknown dtype {value!r}; use one of fp32, bf16, fp16")
    return dtype


def parse_device(value) -> torch.device | None:
    """None or a device that exists here (`cuda` without a GPU is a one-line error)."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {value!r}; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {value!r} requested but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {value!r} does not exist ({torch.cuda.device_count()} CUDA "
                        "devices)")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise UserError(f"unsupported device {value!r}; use cpu or cuda[:N]")
    return device


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_same_dtype(compiled_dtype: torch.dtype, requested: torch.dtype | None) -> None:
    """A graph runs in the dtype it was traced in (see the module docstring)."""
    if requested is not None and requested != compiled_dtype:
        raise UserError(f"this model was compiled in {dtype_name(compiled_dtype)}; to run in "
                        f"{dtype_name(requested)} compile it with --dtype {_SHORT[requested]} "
                        "(a traced graph keeps its precision's casts)")


def within_tolerance(actual: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    """(ok, max abs diff) of `actual` against `expected` under TOLERANCE of `expected`'s dtype."""
    relative, absolute = TOLERANCE.get(expected.dtype, TOLERANCE[torch.float32])
    diff = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    limit = absolute + relative * (expected.float().abs().max().item() if expected.numel() else 0)
    return diff <= limit, diff
