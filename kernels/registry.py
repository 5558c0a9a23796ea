"""Kernel registration, the same for every kernel: a `torch.library.custom_op` named
`rbcompile::<name>` whose default implementation is the plain PyTorch reference (CPU, and the
fake implementation that torch.export / torch.compile trace), with the Triton launcher as its
CUDA implementation when Triton is importable.

`REFERENCES` holds each reference under the op's name (`REFERENCES.rms_norm.default`), for code
that must trace to plain ATen: the module ONNX export runs (codegen's `guards="cond"`).
"""
import types

import torch

REFERENCES = types.SimpleNamespace()


def kernel_op(name: str, reference, cuda=None, mutates_args: tuple[str, ...] = ()):
    """Register `reference` (type-annotated; returns new tensors, or changes the arguments
    `mutates_args` names in place and returns None) as `rbcompile::<name>`."""
    op = torch.library.custom_op(f"rbcompile::{name}", reference, mutates_args=mutates_args)
    op.register_fake(reference)
    if cuda is not None:
        op.register_kernel("cuda", cuda)
    setattr(REFERENCES, name, types.SimpleNamespace(default=reference))
    return op
