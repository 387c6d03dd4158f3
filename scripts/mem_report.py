"""Compiled temporaries of one value-and-grad step, and the largest allocations.

  XLA_FLAGS=--xla_dump_to=DIR python scripts/mem_report.py DIR [k=v ...]

prints ``memory_analysis()`` of the Llama-3 head step (N=8192, or ``tokens=N``;
``dim=D`` and ``vocab=V`` for another head) with the given
``linear_cross_entropy`` options (``weight_layout=dv``: a ``[D, V]``
weight), then the allocations over 8 MiB from XLA's buffer assignment in DIR
(what each temporary holds).
"""

import glob
import re
import sys

import jax
import jax.numpy as jnp

import mst_jax
from mst_jax.bench.cases import parse_impl

N, D, V = 8192, 4096, 128256
dump, spec = sys.argv[1], "mst_jax:" + ",".join(sys.argv[2:])
_, kwargs = parse_impl(spec)
N, D, V = kwargs.pop("tokens", N), kwargs.pop("dim", D), kwargs.pop("vocab", V)
dv = kwargs.get("weight_layout") == "dv"
shapes = (
  jax.ShapeDtypeStruct((N, D), jnp.bfloat16),
  jax.ShapeDtypeStruct((D, V) if dv else (V, D), jnp.bfloat16),
  jax.ShapeDtypeStruct((N,), jnp.int32),
)
loss = lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **kwargs)
step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
stats = step.lower(*shapes).compile().memory_analysis()
print(spec, f"temp {stats.temp_size_in_bytes / 2**20:.1f} MiB")
for path in glob.glob(f"{dump}/*jit__lambda*buffer-assignment.txt"):
  with open(path) as f:
    lines = f.readlines()
  for line in lines:
    match = re.match(r"allocation (\d+): size (\d+)(.*)", line)
    if match and int(match.group(2)) > 8 << 20:
      size = int(match.group(2)) / 2**20
      print(f"  alloc {match.group(1)}: {size:.1f} MiB{match.group(3)[:150]}")
