"""The SM clock and power draw while one LM-head GEMM runs back to back.

On an H200 the head's GEMMs run at the GPU's power limit, which sets the
clock and so the tensor cores' peak (docs/benchmarks.md). This runs
one product of ``python -m mst_jax.bench --kernels`` (XLA's or the Mosaic
kernel) for ``--seconds`` while ``nvidia-smi`` samples the SM clock and the
power draw, and prints one JSON line: the GEMM's TFLOP/s, and the mean clock
and power over the samples taken under load (over half the power limit):

  python scripts/gemm_clock.py --head llama --product logits --impl mosaic

Without ``nvidia-smi`` (a CPU) it times the GEMM and reports no samples.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp

from mst_jax.bench.kernels import GEMM_HEADS, GEMM_PRODUCTS, gemm_fns

QUERY = "clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"


def read_samples(path: str) -> list[dict]:
  """nvidia-smi's rows (``--format=csv,noheader,nounits``) as dicts; rows
  with a field it could not read (``[N/A]``) are left out."""
  rows = []
  with open(path) as f:
    for line in f:
      fields = [x.strip() for x in line.split(",")]
      try:
        mhz, watts, limit = map(float, fields[:3])
      except ValueError:
        continue
      rows.append(dict(mhz=mhz, watts=watts, limit=limit, reasons=fields[3]))
  return rows


def summarise(samples: list[dict]) -> dict:
  """Means of the samples under load (over half the power limit)."""
  loaded = [s for s in samples if s["watts"] > s["limit"] / 2]
  mean = lambda key: sum(s[key] for s in loaded) / len(loaded) if loaded else None
  return dict(
    samples=len(samples),
    loaded_samples=len(loaded),
    mean_mhz=mean("mhz"),
    mean_watts=mean("watts"),
    throttle_reasons=sorted({s["reasons"] for s in loaded}),
  )


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--head", default="llama", choices=sorted(GEMM_HEADS))
  parser.add_argument("--shape", type=int, nargs=3, metavar=("N", "D", "V"))
  parser.add_argument("--product", default="logits")
  parser.add_argument("--layout", default="vd", choices=("vd", "dv"))
  parser.add_argument("--impl", default="xla", choices=("xla", "mosaic"))
  parser.add_argument("--seconds", type=float, default=10.0)
  args = parser.parse_args(argv)
  n, d, v = args.shape or GEMM_HEADS[args.head]
  lhs_name, rhs_name, dims, out_dtype, accumulate = GEMM_PRODUCTS[
    args.product, args.layout
  ]
  if accumulate:
    raise SystemExit("an accumulating product carries its output; time it with bench")
  shapes = {"hidden": (n, d), "dlogits": (n, v)}
  shapes["weight"] = (v, d) if args.layout == "vd" else (d, v)
  key_l, key_r = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(key_l, shapes[lhs_name], jnp.bfloat16)
  rhs = jax.random.normal(key_r, shapes[rhs_name], jnp.bfloat16)
  fn = gemm_fns(dims, out_dtype, False, {"mosaic": None})[args.impl]
  jax.block_until_ready(fn(lhs, rhs))
  with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
    try:
      smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        + ["-lms", "100"],
        stdout=log,
      )
    except FileNotFoundError:
      smi = None
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
      for _ in range(10):
        out = fn(lhs, rhs)
      jax.block_until_ready(out)
      calls += 10
    seconds = (time.perf_counter() - start) / calls
    if smi is not None:
      smi.terminate()
      smi.wait()
    samples = read_samples(log.name)
  result = dict(
    shape=[n, d, v],
    product=args.product,
    layout=args.layout,
    impl=args.impl,
    ms=seconds * 1e3,
    tflops=2 * n * d * v / seconds / 1e12,
    **summarise(samples),
  )
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
