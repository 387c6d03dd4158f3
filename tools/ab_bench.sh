#!/usr/bin/env bash
# A/B timing on one GPU: `python -m mst_jax.bench` for a baseline tree and for
# this one, interleaved, each process importing only its own tree.
#   BASE=path/to/old/tree [ROUNDS=2] [CASES="llama llama_32k"] [BENCH_FLAGS=--no-memory] \
#     tools/ab_bench.sh
# BASE is a directory holding an older mst_jax/ package (e.g. `git archive REV mst_jax
# | tar -x -C DIR`). Logs and JSON go under $OUT/{base,new}_ROUND.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
new=$PWD; base=$(cd "${BASE:?set BASE to the baseline tree}" && pwd)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
cd "$(mktemp -d)" || exit 1  # no tree shadows the other through the working directory
for round in $(seq "${ROUNDS:-2}"); do
  for tree in base new; do
    root=$new; [ "$tree" = base ] && root=$base
    log="$OUT/${tree}_$round.txt"
    PYTHONPATH=$root python3 -c 'import mst_jax; print("tree:", mst_jax.__file__)' > "$log"
    # shellcheck disable=SC2086
    PYTHONPATH=$root python3 -m mst_jax.bench --cases ${CASES:-llama llama_32k} \
      --impls naive_cast mst_jax ${BENCH_FLAGS:-} --out "$OUT/${tree}_$round" >> "$log" 2>&1
    echo "== $tree round $round (rc=$?)"; grep -E "^tree:|ms|x " "$log" | tail -n 12
  done
done
