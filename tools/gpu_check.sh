#!/usr/bin/env bash
# Checks and measurements on a GPU machine, from the repository root:
#   [BENCH_ARGS=...] [HLO_VARIANTS="k=v k=v;..."] tools/gpu_check.sh STEP [STEP ...]
# Steps: compile (fresh-process compile times, tools/compile_time.py),
# gpu_tests (every GPU test, one process), gpu_a, gpu_b, gpu_c (the GPU
# tests in three parts, three xdist workers each; gpu_a runs the 131072-row test
# alone first, since it takes 65 GiB), suite (CPU tests), kernels, bench, multi
# (two GPUs), fit, long (examples/long_context.py), hlo (tools/hlo_report.py per
# variant), bundle (packs $OUT into one bundle.tgz).
# It installs the tree (pip -e; SKIP_INSTALL=1 skips that), records the GPU and
# jax versions in $OUT/env.txt, and writes each step's log under $OUT, each step
# under its own time limit.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"
if [ -z "${SKIP_INSTALL:-}" ]; then
  pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 1; }
fi

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$? in $((SECONDS - t0))s"; tail -n "${TAIL:-30}" "$OUT/$name.txt"
}

if ls .whl/*.whl >/dev/null 2>&1; then  # peer packages (jax_cce) as wheels in .whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
for what in "$@"; do
  case $what in
    compile) step compile ${COMPILE_LIMIT:-400} python3 tools/compile_time.py llama naive_cast mst_jax \
               --cases gemma llama_32k ;;
    gpu_tests) step gpu_tests ${TESTS_LIMIT:-240} python3 -m pytest -q -m gpu -rs ${TESTS_K:+-k "$TESTS_K"} tests ;;
    gpu_a) step gpu_peer 150 python3 -m pytest -q -m gpu -rfE tests/test_peer_bugs.py  # 65 GiB: alone
           step gpu_a 430 python3 -m pytest -q -m gpu -rfE -n 3 tests/test_mosaic_gemm.py tests/test_mosaic_head.py ;;
    gpu_b) step gpu_b 330 python3 -m pytest -q -m gpu -rfE -n 3 tests/test_mosaic_bias.py tests/test_mosaic_distill.py \
             tests/test_distillation.py tests/test_backends.py tests/test_autodiff_patterns.py ;;
    gpu_c) step gpu_c 330 python3 -m pytest -q -m gpu -rfE -n 3 tests/test_mosaic_ce.py tests/test_mosaic_stats.py \
             tests/test_class_weights.py tests/test_log_probs.py tests/test_reliability.py tests/test_tma_rows.py \
             tests/test_token_weights.py tests/test_vocab_blocked.py tests/test_top_k.py ;;
    suite) step suite 300 python3 -m pytest -q -x -m "not gpu" tests/test_linear_cross_entropy.py tests/test_chunked.py ;;
    kernels) step kernels 300 python3 -m mst_jax.bench --kernels --reps 20 --blocks ${BLOCKS:-1x2048x4} ;;
    bench) step bench ${BENCH_LIMIT:-400} python3 -m mst_jax.bench --out "$OUT/bench" $BENCH_ARGS
           cp "$OUT/bench/bench.png" "$OUT/bench/results.json" "$OUT/" 2>/dev/null ;;
    multi) step multi ${MULTI_LIMIT:-300} python3 -m mst_jax.bench --out "$OUT/multi" \
             --cases llama_16k llama_16k_dp llama_16k_vp --impls naive_cast mst_jax ;;
    fit) XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 step fit ${FIT_LIMIT:-300} python3 -m mst_jax.bench \
             --fit ${FIT_FROM:+--fit-from $FIT_FROM} ${FIT_RAN:+--fit-ran $FIT_RAN} ${FIT_ATTEMPT_TIMEOUT:+--fit-attempt-timeout $FIT_ATTEMPT_TIMEOUT} --fit-granularity ${FIT_GRANULARITY:-32768} --cases llama --impls ${FIT_IMPLS:-naive_cast mst_jax} --out "$OUT/fit" ;;
    bundle) (cd "$OUT" && tar czf ../bundle.tgz . && rm -rf ./* && mv ../bundle.tgz .) ;;
    long) step long_context ${LONG_LIMIT:-300} python3 examples/long_context.py $LONG_ARGS ;;
    hlo) IFS=';' read -ra variants <<< "${HLO_VARIANTS:-}"
         for v in "${variants[@]}"; do step "hlo_$(echo "$v" | tr -c 'a-z0-9' _)" 120 python3 tools/hlo_report.py $v; done ;;
    *) echo "unknown step $what"; exit 2 ;;
  esac
done
