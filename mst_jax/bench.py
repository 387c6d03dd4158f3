"""Benchmark CLI: ``python -m mst_jax.bench``.

Compares ``mst_jax.linear_cross_entropy`` with the naive full-logits loss
(``jnp.dot`` to float32 logits, ``logsumexp`` minus the target logit, masked
mean, under ``jax.jit``) on the same inputs: loss and gradient agreement,
median step time of ``value_and_grad`` with respect to hidden and weight, and
the compiled temporary memory (``compiled.memory_analysis()``). The default
size runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import mst_jax


def naive_loss(hidden, weight, labels, where):
  """The baseline: full ``[N, V]`` float32 logits, then a masked mean."""
  logits = jnp.dot(hidden, weight.T, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  count = jnp.maximum(jnp.sum(where), 1)
  return jnp.sum(jnp.where(where, lse - target, 0.0)) / count


def make_inputs(key, n_tokens, dim, vocab, dtype, masked_fraction=0.0):
  """Random hidden ``[N, D]``, weight ``[V, D]``, labels and mask."""
  k_h, k_w, k_y, k_m = jax.random.split(key, 4)
  hidden = jax.random.normal(k_h, (n_tokens, dim), jnp.float32).astype(dtype)
  weight = (jax.random.normal(k_w, (vocab, dim), jnp.float32) / np.sqrt(dim)).astype(
    dtype
  )
  labels = jax.random.randint(k_y, (n_tokens,), 0, vocab)
  where = jax.random.uniform(k_m, (n_tokens,)) >= masked_fraction
  return hidden, weight, labels, where


def _step(loss_fn: Callable) -> Callable:
  return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))


def _median_seconds(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _temp_bytes(fn, args) -> int:
  return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def _rel_err(out, ref) -> float:
  out, ref = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (out, ref))
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def run(args: argparse.Namespace) -> list[dict]:
  """Measures naive and mst_jax once each; returns one row per implementation."""
  dtype = jnp.dtype(args.dtype)
  inputs = make_inputs(
    jax.random.key(args.seed),
    args.tokens,
    args.dim,
    args.vocab,
    dtype,
    args.masked_fraction,
  )

  def ours(hidden, weight, labels, where):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      where=where,
      chunk_size=args.chunk_size,
      impl=args.impl,
    )

  steps = {"naive": _step(naive_loss), "mst_jax": _step(ours)}
  results = {name: step(*inputs) for name, step in steps.items()}
  ref_loss, ref_grads = results["naive"]
  flops = 6 * args.tokens * args.dim * args.vocab
  rows = []
  for name, step in steps.items():
    loss, grads = results[name]
    seconds = _median_seconds(step, inputs, args.reps)
    rows.append(
      {
        "impl": name,
        "loss": float(loss),
        "loss_rel_err": _rel_err(loss, ref_loss),
        "dhidden_rel_err": _rel_err(grads[0], ref_grads[0]),
        "dweight_rel_err": _rel_err(grads[1], ref_grads[1]),
        "median_ms": seconds * 1e3,
        "tflops": flops / seconds / 1e12,
        "temp_mib": _temp_bytes(step, inputs) / 2**20,
      }
    )
  return rows


def format_table(rows: Sequence[dict]) -> str:
  naive = next(r for r in rows if r["impl"] == "naive")
  header = (
    f"{'impl':<8} {'loss':>9} {'loss err':>9} {'dh err':>9} {'dw err':>9}"
    f" {'median ms':>10} {'TFLOP/s':>8} {'temp MiB':>9} {'time x':>7} {'mem x':>7}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r['impl']:<8} {r['loss']:>9.5f} {r['loss_rel_err']:>9.1e}"
      f" {r['dhidden_rel_err']:>9.1e} {r['dweight_rel_err']:>9.1e}"
      f" {r['median_ms']:>10.2f} {r['tflops']:>8.3f} {r['temp_mib']:>9.1f}"
      f" {r['median_ms'] / naive['median_ms']:>7.2f}"
      f" {r['temp_mib'] / max(naive['temp_mib'], 1e-9):>7.3f}"
    )
  return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m mst_jax.bench",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--tokens", type=int, default=2048, help="N (default 2048)")
  parser.add_argument("--dim", type=int, default=128, help="D (default 128)")
  parser.add_argument("--vocab", type=int, default=16384, help="V (default 16384)")
  parser.add_argument(
    "--dtype", default="float32", choices=["float32", "bfloat16", "float16"]
  )
  parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk")
  parser.add_argument("--impl", default=None, help="mst_jax impl (default automatic)")
  parser.add_argument(
    "--masked-fraction",
    type=float,
    default=0.0,
    help="fraction of tokens excluded at random",
  )
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  device = jax.devices()[0]
  print(
    f"jax {jax.__version__} on {device.platform} ({device.device_kind});"
    f" N={args.tokens} D={args.dim} V={args.vocab} {args.dtype},"
    f" value_and_grad wrt hidden and weight"
  )
  print(format_table(run(args)))


if __name__ == "__main__":
  main()
