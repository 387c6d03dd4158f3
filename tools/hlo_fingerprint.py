"""Prints the buffers of the optimized programs the "no [V, D] copy" test checks.

For each of its four configurations: the compiled memory analysis and the
multiset of (shape, opcode) of the entry and loop computations' instructions.
Two trees that print the same text compile to the same buffers. Run from the
tree to fingerprint: ``python tools/hlo_fingerprint.py > before.txt``.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

import mst_jax

CONFIGS = [
  ("fused", None, None),
  ("fused", None, jnp.float32),
  ("fused", jnp.float32, None),
  ("recompute", None, None),
]


def main() -> None:
  vocab, dim, n_rows = 1031, 64, 3000
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.1, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
  where = jnp.arange(n_rows) < 2100
  instruction = re.compile(r"^\s*(?:ROOT )?\S+ = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\(")
  for grad_mode, logits_dtype, accum_dtype in CONFIGS:
    options = dict(grad_mode=grad_mode, logits_dtype=logits_dtype)
    loss = functools.partial(
      mst_jax.linear_cross_entropy, labels=labels, where=where, impl="xla"
    )
    fn = jax.value_and_grad(
      functools.partial(
        loss, memory_budget=700 * vocab * 4, accum_dtype=accum_dtype, **options
      ),
      argnums=(0, 1),
    )
    compiled = jax.jit(fn).lower(hidden, weight).compile()
    stats = compiled.memory_analysis()
    print(f"== {grad_mode} logits={logits_dtype} accum={accum_dtype}")
    print(
      "temp",
      stats.temp_size_in_bytes,
      "args",
      stats.argument_size_in_bytes,
      "out",
      stats.output_size_in_bytes,
      "alias",
      stats.alias_size_in_bytes,
    )
    counts = collections.Counter()
    for line in compiled.as_text().splitlines():
      match = instruction.match(line)
      if match:
        counts[match.groups()] += 1
    for (shape, op), count in sorted(counts.items()):
      print(f"  {count:4d} {op} {shape}")


if __name__ == "__main__":
  main()
