"""Fused kernels (Triton on CUDA, PyTorch reference on CPU). Each kernel lives in its own file."""
