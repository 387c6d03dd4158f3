#!/usr/bin/env bash
# Checks mst_jax on a GPU with whatever jax is first on the Python path (a new
# jax release included), from the repository root:
#
#   scripts/check_jax.sh [OUT_DIR]        # default OUT_DIR: check_out
#
# 1. env.txt: the GPU, jax, jaxlib and the CUDA plugin versions;
# 2. tests.txt: the GPU tests (python -m pytest -m gpu): the one holding up to
#    65 GiB and the one reading the allocator's peak alone, then the rest on
#    $WORKERS xdist workers (default 6) with JAX's platform allocator, which
#    frees what a test drops (each worker's default pool keeps its peak: five
#    such workers ran an H100 out of memory);
# 3. bench/: the README's GPU case (python -m mst_jax.bench: the Llama-3 head,
#    mst_jax against the naive head in the same run), with $BENCH_ARGS added.
# STEPS="tests bench" (the default) picks the steps; TESTS (default: tests)
# the test paths; TESTS_LIMIT and
# BENCH_LIMIT (seconds, default 1800 each) cap them. The exit status is
# nonzero if any step failed or ran out of time.
set -u
OUT=${1:-check_out}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
failed=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda)"
} 2>&1 | tee "$OUT/env.txt"

step() { # step NAME LIMIT COMMAND...: runs COMMAND under LIMIT seconds, logs to OUT/NAME.txt
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name: $*"
  # SIGINT first: pytest then still prints which tests failed and why
  timeout -s INT -k 30 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 15 "$OUT/$name.txt"
  [ "$rc" = 0 ] || failed=1
}

for what in ${STEPS:-tests bench}; do
  case $what in
    tests)
      big=tests/test_peer_bugs.py # up to 65 GiB of GPU memory
      peak=tests/test_reliability.py::test_repeated_train_steps_keep_peak_memory_flat
      paths=${TESTS:-tests}
      alone=()
      [[ $paths = tests || " $paths " == *" $big "* ]] && alone+=("$big")
      [[ $paths = tests || " $paths " == *" ${peak%::*} "* ]] && alone+=("$peak")
      if ((${#alone[@]})); then
        step tests "${TESTS_LIMIT:-1800}" python3 -m pytest -v -m gpu -rfEs "${alone[@]}"
      fi
      XLA_PYTHON_CLIENT_ALLOCATOR=platform step tests "${TESTS_LIMIT:-1800}" \
        python3 -m pytest -v -m gpu -rfEs --durations=20 -n "${WORKERS:-6}" \
        --ignore="$big" --deselect="$peak" $paths
      ;;
    bench)
      step bench "${BENCH_LIMIT:-1800}" python3 -m mst_jax.bench --out "$OUT/bench" ${BENCH_ARGS:-}
      ;;
    *) echo "unknown step $what (steps: tests bench)" && exit 2 ;;
  esac
done
exit $failed
