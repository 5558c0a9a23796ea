"""Giving back the memory of weights read from the artifact's file once nothing reads them.

safetensors maps the artifact's weights from its file: a page is read in when first touched and
stays resident. After onnxruntime has prepacked its own copy of the full path's weights, the
mapped pages are needed only by other graphs and the torch executor, which read them back from
the file if they run. Only tensors lying wholly in a file mapping are released (MADV_PAGEOUT):
tensors in process memory (a dequantized packed artifact, stacked copies, a model compiled in
this process) are left alone, so nothing is swapped out.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import torch

MADV_PAGEOUT = 21   # Linux 5.4+


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings backed by a file (Linux; else none)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    spans = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            spans.append((start, end))
    return spans


def release_file_pages(tensors: list[torch.Tensor]) -> int:
    """Pages out the whole pages of each tensor that lies in a file mapping; returns how many
    tensors were released. Data is never lost: the pages come back from the file if read."""
    if not sys.platform.startswith("linux"):
        return 0
    spans = file_mappings()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released = mmap.PAGESIZE, 0
    for tensor in tensors:
        first = tensor.data_ptr()
        last = first + tensor.numel() * tensor.element_size()
        start, end = -(-first // page) * page, last // page * page
        if end > start and any(low <= first and last <= high for low, high in spans):
            released += libc.madvise(start, end - start, MADV_PAGEOUT) == 0
    return released
