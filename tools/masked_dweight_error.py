"""Gradient errors with masked tokens, against float64 and a naive bf16 head.

bfloat16, N=4096, D=512, V=32000 (``--small``: 256, 32, 1031, for a CPU),
three masks (three tokens, 40% at random, none), each with the default plan,
``--budget`` bytes, and that budget with ``dweight`` in place
(``accum_dtype=jnp.bfloat16``). Prints the loss's relative error and the
relative (Frobenius) errors of ``dhidden`` and ``dweight``, the naive head's
beside them, and each step's first-call seconds (compiling included).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import mst_jax

jax.config.update("jax_enable_x64", True)


def _rel(out, ref) -> float:
  out, ref = np.asarray(out.astype(jnp.float64)), np.asarray(ref)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _naive(hidden, weight, labels):
  logits = (hidden @ weight.T).astype(jnp.float32)
  safe = jnp.maximum(labels, 0)
  target = jnp.take_along_axis(logits, safe[:, None], 1)[:, 0]
  per_row = jax.nn.logsumexp(logits, -1) - target
  return jnp.sum(jnp.where(labels >= 0, per_row, 0.0)) / jnp.sum(labels >= 0)


def _grad(f, labels, **options):
  loss = lambda h, w: f(h, w, labels, **options)
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def _report(name, hidden, weight, labels, budget) -> None:
  cross_entropy = mst_jax.linear_cross_entropy
  ref_loss, ref = _grad(cross_entropy, labels, impl="reference")(
    hidden.astype(jnp.float64), weight.astype(jnp.float64)
  )
  _, naive = _grad(_naive, labels)(hidden, weight)
  budget = dict(memory_budget=budget)
  for options in ({}, budget, dict(budget, accum_dtype=jnp.bfloat16)):
    start = time.time()
    value, grads = _grad(cross_entropy, labels, **options)(hidden, weight)
    shown = {k: getattr(v, "__name__", v) for k, v in options.items()}
    print(
      name,
      shown,
      f"loss {abs(float(value) / float(ref_loss) - 1):.1e}",
      f"dh {_rel(grads[0], ref[0]):.2e} (naive {_rel(naive[0], ref[0]):.2e})",
      f"dw {_rel(grads[1], ref[1]):.2e} (naive {_rel(naive[1], ref[1]):.2e})",
      f"{time.time() - start:.0f}s",
      flush=True,
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--budget", type=int, default=64 << 20)
  args = parser.parse_args()
  n_rows, dim, vocab = (256, 32, 1031) if args.small else (4096, 512, 32000)
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.05, jnp.bfloat16)
  targets = rng.integers(0, vocab, n_rows)
  for name, fraction in [("three", None), ("0.4", 0.4), ("none", 0.0)]:
    valid = rng.random(n_rows) >= (fraction or 0.0)
    if fraction is None:
      valid[rng.choice(n_rows, 3, replace=False)] = False
    labels = jnp.asarray(np.where(valid, targets, -100), jnp.int32)
    _report(name, hidden, weight, labels, args.budget)


if __name__ == "__main__":
  main()
