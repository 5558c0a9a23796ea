"""rbcompile's own Python in a child process (`python -m rbcompile...`, `python -c`).

`python -m` and `-c` put the working directory first on sys.path. In a checkout of rbcompile
that directory holds `kernels/` (installed as `rbcompile.kernels`), which would shadow Hugging
Face's `kernels` package, imported by transformers 5.25 onwards as soon as a model config is.
PYTHONSAFEPATH=1 (Python 3.11+) keeps it off. A child that can run in a folder of its own (the
ONNX validation) does that instead, which holds on any Python.
"""
from __future__ import annotations

import os

SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child, with SAFE_PATH and `overrides`."""
    return {**os.environ, **SAFE_PATH, **overrides}
