#!/usr/bin/env bash
# The kernels' GPU check, one script:  benchmarks/gpu_check.sh OUT_DIR
#
# On a CUDA machine: runs tests/test_kernels.py with the compiled Triton kernels on the GPU
# (TRITON_INTERPRET=0: the launchers, and the ops' CUDA dispatch, on CUDA tensors), then
# benchmarks/bench_kernels.py (do_bench: reference, torch.compile'd reference, Triton). Writes
# OUT_DIR/{env.txt,test_kernels.log,bench_kernels.log,bench_kernels.csv}; about 2-4 minutes,
# each step under a timeout (130 s + 150 s). Exits non-zero with one line when there is no CUDA
# device, when the interpreter is missing, or when either step fails.
# Python: ${PYTHON:-.venv/bin/python}, from the repository root.
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no python at $PY (set PYTHON=...)" >&2; exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing run" >&2; exit 3
fi

export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
{
    date -Is
    git rev-parse HEAD 2>/dev/null
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())'
    nvidia-smi 2>&1 | head -20
} > "$OUT/env.txt" 2>&1

timeout -k 5 130 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py --durations=10 \
    > "$OUT/test_kernels.log" 2>&1
test_rc=$?
timeout -k 5 150 "$PY" benchmarks/bench_kernels.py --csv "$OUT/bench_kernels.csv" \
    > "$OUT/bench_kernels.log" 2>&1
bench_rc=$?

echo "gpu_check: tests rc=$test_rc ($(tail -n 1 "$OUT/test_kernels.log")); bench rc=$bench_rc;" \
     "logs in $OUT" | tee "$OUT/summary.txt"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
