"""The Mosaic GEMM's products of a narrow hidden size, against float32 XLA.

Computes the head's products that have a hidden-size side (``dhidden`` and
``dweight`` in both layouts) at ``--dims`` for the default config and for
configs with the narrow side's tiles at 64 or 128 (those that
``narrow_error`` refuses are reported as errors), printing each one's
relative error (max |out - ref| / max |ref|) and the scale
``<out, ref> / <ref, ref>`` (1 when right):

  python tools/narrow_gemm.py --dims 64 128 --rows 1000 1024 --out narrow.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._gemm.mosaic.config import GemmConfig

# name: (lhs shape, rhs shape, dimension numbers, out dtype, accumulate), for
# hidden [N, D], dlogits [N, V] and the weight [V, D] ("vd") or [D, V] ("dv").
_PRODUCTS = {
  "dweight_vd": lambda n, d, v: ((n, v), (n, d), (0, 0), jnp.float32, True),
  "dweight_dv": lambda n, d, v: ((n, d), (n, v), (0, 0), jnp.float32, True),
  "first_dweight_vd": lambda n, d, v: ((n, v), (n, d), (0, 0), jnp.float32, False),
  "first_dweight_dv": lambda n, d, v: ((n, d), (n, v), (0, 0), jnp.float32, False),
  "bf16_dweight_vd": lambda n, d, v: ((n, v), (n, d), (0, 0), jnp.bfloat16, True),
  "first_bf16_dweight_vd": lambda n, d, v: (
    (n, v),
    (n, d),
    (0, 0),
    jnp.bfloat16,
    False,
  ),
  "dhidden_vd": lambda n, d, v: ((n, v), (v, d), (1, 0), jnp.bfloat16, False),
  "dhidden_dv": lambda n, d, v: ((n, v), (d, v), (1, 1), jnp.bfloat16, False),
}


def _configs(default: GemmConfig, narrow_n: bool, narrow_m: bool):
  """The default config, and ones with the narrow side's tile cut to 64."""
  yield "default", None
  if narrow_n:
    for split in ("tiles", "m"):
      for epilogue_n in (64, 32):
        yield (
          f"tile_n=64 split={split} epi_n={epilogue_n}",
          dataclasses.replace(default, tile_n=64, epilogue_n=epilogue_n, split=split),
        )
    yield "tile_n=128", dataclasses.replace(default, tile_n=128, epilogue_n=64)
  if narrow_m:
    for split in ("tiles", "n"):
      yield (
        f"tile_m=64 split={split}",
        dataclasses.replace(default, tile_m=64, split=split),
      )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--rows", type=int, nargs="+", default=[1000, 1024])
  parser.add_argument("--vocab", type=int, default=4160)
  parser.add_argument("--products", nargs="+", default=sorted(_PRODUCTS))
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  rows = []
  key = jax.random.key(0)
  for name in args.products:
    shapes = _PRODUCTS[name]
    for d in args.dims:
      for n in args.rows:
        lhs_shape, rhs_shape, (lc, rc), out_dtype, acc = shapes(n, d, args.vocab)
        k1, k2, k3, key = jax.random.split(key, 4)
        lhs = jax.random.normal(k1, lhs_shape, jnp.bfloat16)
        rhs = jax.random.normal(k2, rhs_shape, jnp.bfloat16)
        dims = (((lc,), (rc,)), ((), ()))
        ref = jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)
        addend = jax.random.normal(k3, ref.shape, out_dtype) if acc else None
        if acc:
          ref = ref + addend.astype(jnp.float32)
        m_out, n_out = ref.shape
        problem = mosaic_gemm._check(lhs, rhs, dims, out_dtype, addend)  # noqa: SLF001
        default = mosaic_gemm._config(problem)  # noqa: SLF001
        narrow_m = lc == 0 and m_out < 128
        for label, config in _configs(default, n_out < 128, narrow_m):
          row = {"product": name, "d": d, "n": n, "config": label}
          if config is None:
            row["default"] = repr(default)
          try:
            out = mosaic_gemm.matmul(
              lhs, rhs, dims, out_dtype, accumulate=addend, config=config
            )
            out = np.asarray(out.astype(jnp.float32), np.float64)
            want = np.asarray(ref, np.float64)
            row["rel_err"] = float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
            row["scale"] = float(np.vdot(out, want) / np.vdot(want, want))
          except Exception as e:  # noqa: BLE001 (a config that does not lower)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
          rows.append(row)
          print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
