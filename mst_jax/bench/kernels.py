"""The per-chunk CE kernels alone: XLA against Pallas block configurations.

For each chunk shape, times ``forward`` (statistics), ``backward`` (bf16
dlogits) and ``forward_backward`` (fused) on float32 logits, and reports the
bandwidth achieved against the floor: one read of the logits (forward), plus
one write of dlogits (backward and fused), and against the device-to-device
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from mst_jax import _backends as backends
from mst_jax import _ce_math as ce_math
from mst_jax._backends.pallas_triton import KernelBlocks, PallasTritonChunkCE


def _mean_seconds_async(fn, args, reps: int) -> float:
  """Mean time of ``reps`` back-to-back dispatches (launch gaps overlap)."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / reps


def warm_up(seconds: float = 3.0) -> None:
  """Runs matmuls for ``seconds`` so the GPU's clocks leave their idle state.

  An idle H200 sits at 345 MHz; timing right away measured a quarter of the
  copy bandwidth (0.95 TB/s) in our first run.
  """
  x = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
  matmul = jax.jit(lambda a: a @ a)
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    jax.block_until_ready(matmul(x))


def copy_bandwidth(n_bytes: int = 2**30, reps: int = 50) -> float:
  """Device-to-device copy bandwidth in bytes/s, counting bytes read + written.

  The pass scales a buffer in place (the input is donated), so no iteration
  allocates: our second run allocated a fresh 4 GiB output per iteration and
  measured 1.76 TB/s, under half of what the kernels themselves then reached.
  """
  x = jax.random.normal(jax.random.key(1), (n_bytes // 4,), jnp.float32)
  scale = jnp.float32(1.0001)  # an argument, so XLA cannot elide the pass
  fn = jax.jit(lambda x, s: x * s, donate_argnums=0)
  x = jax.block_until_ready(fn(x, scale))
  start = time.perf_counter()
  for _ in range(reps):
    x = fn(x, scale)
  jax.block_until_ready(x)
  return 2 * n_bytes * reps / (time.perf_counter() - start)


def parse_blocks(text: str) -> KernelBlocks:
  """``"1x4096x8"`` (rows x block_v x warps[xstages]) -> ``KernelBlocks``."""
  fields = [int(f) for f in text.split("x")]
  return KernelBlocks(*fields)


def run_kernels(args: argparse.Namespace) -> list[dict]:
  """Times every pass of every backend on every chunk shape; prints as it goes."""
  warm_up()
  bandwidth = copy_bandwidth()
  print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")
  options = ce_math.CEOptions()
  impls = {"xla": backends.XlaChunkCE()}
  for text in args.blocks:
    impls[f"pallas {text}"] = PallasTritonChunkCE(
      blocks=parse_blocks(text), interpret=jax.default_backend() != "gpu"
    )
  rows = []
  for shape in args.chunk_shapes:
    n_rows, vocab = (int(f) for f in shape.split("x"))
    key = jax.random.key(args.seed)
    logits = 3.0 * jax.random.normal(key, (n_rows, vocab), jnp.float32)
    labels = jax.random.randint(key, (n_rows,), 0, vocab)
    valid = jnp.ones((n_rows,), bool)
    g_loss = jnp.full((n_rows,), 1.0 / n_rows, jnp.float32)
    logit_bytes, dlogit_bytes = n_rows * vocab * 4, n_rows * vocab * 2
    lse = jax.nn.logsumexp(logits, axis=-1)
    back_rows = ce_math.backward_rows(
      g_loss, jnp.zeros_like(lse), lse, labels, valid, options, vocab
    )
    for name, backend in impls.items():
      passes = {
        "forward": (
          jax.jit(lambda lg, y, b=backend: b.forward(lg, y, options)),
          (logits, labels),
          logit_bytes,
        ),
        "backward": (
          jax.jit(
            lambda lg, y, r, b=backend: b.backward(lg, y, r, options, jnp.bfloat16)
          ),
          (logits, labels, back_rows),
          logit_bytes + dlogit_bytes,
        ),
        "fused": (
          jax.jit(
            lambda lg, y, v, g, b=backend: b.forward_backward(
              lg, y, v, g, options, jnp.bfloat16
            )
          ),
          (logits, labels, valid, g_loss),
          logit_bytes + dlogit_bytes,
        ),
      }
      for pass_name, (fn, fn_args, floor_bytes) in passes.items():
        seconds = _mean_seconds_async(fn, fn_args, args.reps)
        rows.append(
          {
            "chunk": shape,
            "impl": name,
            "pass": pass_name,
            "ms": seconds * 1e3,
            "tb_s": floor_bytes / seconds / 1e12,
            "of_copy": floor_bytes / seconds / bandwidth,
          }
        )
        print(
          f"{shape:>12} {name:<22} {pass_name:<9} {seconds * 1e3:8.3f} ms"
          f" {floor_bytes / seconds / 1e12:6.2f} TB/s"
          f" {floor_bytes / seconds / bandwidth:6.1%} of copy",
          flush=True,
        )
  return rows
