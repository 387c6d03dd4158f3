#!/usr/bin/env bash
# One build-check-measure cycle on the lent H200, from the repo root there:
#   scripts/h200_check.sh [gpu_tests] [suite] [kernels] [e2e] ...
# Logs go under $OUT; each step has its own time limit so the call ends in time.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"
pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - t0))s"; tail -n "${TAIL:-30}" "$OUT/$name.txt"
}

LLAMA="--tokens 8192 --dim 4096 --vocab 128256 --dtype bfloat16"
for what in "$@"; do
  case $what in
    gpu_tests) step gpu_tests 240 python3 -m pytest -q -m gpu -rs tests ;;
    suite) step suite 300 python3 -m pytest -q -x -m "not gpu" tests/test_linear_cross_entropy.py tests/test_chunked.py ;;
    kernels) step kernels 300 python3 -m mst_jax.bench --kernels --reps 20 --blocks ${BLOCKS:-1x4096x8} ;;
    e2e) step e2e 200 python3 -m mst_jax.bench $LLAMA --reps 10 --impl xla pallas ;;
    *) echo "unknown step $what"; exit 2 ;;
  esac
done
