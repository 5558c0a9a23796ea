#!/usr/bin/env bash
# The one GPU check:  benchmarks/gpu_check.sh OUT_DIR        (about 7 minutes on one H200)
#
# 1. native kernel tests (tests/test_kernels.py with TRITON_INTERPRET=0, on CUDA tensors);
# 2. kernel benchmark (benchmarks/bench_kernels.py: reference, torch.compile'd reference, Triton);
# 3. grouped-head attention (benchmarks/bench_gqa.py, bf16: repeat_kv copies, enable_gqa and
#    folded queries, and the form rbcompile/artifact/attention.py takes on CUDA: folded for decode and
#    verify steps, copies elsewhere; with a mask, and causal without one, where flash attention
#    takes grouped heads: whether the runtime should take enable_gqa there);
# 4. end-to-end benchmark (benchmarks/bench_gpu.py: BERT-base fp16, SmolLM2-sized Llama bf16
#    prefill and decode, 1B-sized Llama bf16 prefill; eager, inductor, rbcompile; parity).
# STEPS picks steps (default "test_kernels bench_kernels bench_gqa bench_gpu"; "tune_kernels" sweeps the
# kernels' launch configs with benchmarks/tune_kernels.py); DEADLINE_S bounds bench_gpu, CASES
# picks its cases, SKIP contenders not to run, PROFILE contenders whose kernels are profiled
# (default inductor, inductor-ro, rbc-graphs, rbc-k-graphs, rbc-generate; "" for none).
# Each step runs under a timeout, cut to what is left of BUDGET_S (default 450: the issue's
# 8 minutes, leaving a 15-minute lease room for tune_kernels and a machine start), the
# end-to-end one also under its own deadline (DEADLINE_S, at most 90 s before its limit). Writes at most
# 8 files into OUT_DIR (env.txt, 4 logs, bench_kernels.csv, bench_gpu.json, summary.txt) and
# prints a summary. Exits non-zero with one line when there is no CUDA device or a step fails.
# Python: ${PYTHON:-python3} (the machine's own: nothing is installed there; rbcompile is laid
# out as installed in a temporary folder and put on PYTHONPATH unless it imports already).
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no python at $PY (set PYTHON=...)" >&2; exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PY (no torch, or torch.cuda.is_available() is False); nothing run" >&2; exit 3
fi
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# rbcompile as installed (passes/, kernels/, runtime/ under rbcompile/, the dynamo entry point)
if ! "$PY" -c 'import rbcompile.kernels' 2>/dev/null; then
    SITE=$(mktemp -d)
    cp -r rbcompile "$SITE/rbcompile"
    for sub in passes kernels runtime; do cp -r "$sub" "$SITE/rbcompile/$sub"; done
    mkdir -p "$SITE/rbcompile-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: rbcompile\nVersion: 0.1.0\n' > "$SITE/rbcompile-0.1.0.dist-info/METADATA"
    printf '[torch_dynamo_backends]\nrbcompile = rbcompile.frontend.backend:rbcompile_backend\n' \
        > "$SITE/rbcompile-0.1.0.dist-info/entry_points.txt"
    # PYTHONSAFEPATH: the checkout's own rbcompile/ (not laid out as installed) must not shadow it
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1
fi

{
    date -Is
    git rev-parse HEAD 2>/dev/null
    "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
} > "$OUT/env.txt" 2>&1

BUDGET=${BUDGET_S:-450}
left() { echo $((BUDGET - SECONDS)); }
step() {  # step NAME TIMEOUT_S COMMAND... : run, log to OUT/NAME.log, remember the exit code
    local name=$1 limit=$2; shift 2
    (( limit > $(left) )) && limit=$(left)
    if (( limit < 30 )); then
        echo "$name: not run (${BUDGET} s budget spent)" | tee -a "$OUT/summary.txt"; return 1
    fi
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start)) s ($(tail -n 1 "$OUT/$name.log"))" | tee -a "$OUT/summary.txt"
    return $rc
}
: > "$OUT/summary.txt"
rc=0
for name in ${STEPS:-test_kernels bench_kernels bench_gqa bench_gpu}; do
    case $name in
        tune_kernels) PYTHONPATH="$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" step tune_kernels 150 "$PY" benchmarks/tune_kernels.py --json "$OUT/tune_kernels.json" ;;
        test_kernels) step test_kernels 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -x ;;
        bench_kernels) step bench_kernels 150 "$PY" benchmarks/bench_kernels.py --csv "$OUT/bench_kernels.csv" ;;
        bench_gqa) step bench_gqa 60 "$PY" benchmarks/bench_gqa.py --device cuda --dtype bf16 --json - ;;
        bench_gpu) limit=$(( $(left) < 330 ? $(left) : 330 )); deadline=${DEADLINE_S:-240}
                   (( deadline > limit - 90 )) && deadline=$(( limit > 90 ? limit - 90 : 0 ))
                   step bench_gpu 330 "$PY" benchmarks/bench_gpu.py --out "$OUT" --deadline-s "$deadline" \
                          --cases "${CASES:-smol-decode,llama1b,bert,smol-prefill}" --skip "${SKIP:-}" \
                          --profile "${PROFILE-inductor,inductor-ro,rbc-graphs,rbc-k-graphs,rbc-generate}" ;;
        *) echo "gpu_check: unknown step $name" >&2; false ;;
    esac || rc=1
done
sed -n '/^bench_gpu /,$p' "$OUT/bench_gpu.log" 2>/dev/null   # the whole summary table
echo "gpu_check: $([ $rc -eq 0 ] && echo ok || echo FAILED) in $SECONDS s; logs in $OUT"
exit $rc
