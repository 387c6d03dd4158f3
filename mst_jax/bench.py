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
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import mst_jax


def naive_loss(hidden, weight, labels, where, *, cast_logits=False):
  """The baseline: full ``[N, V]`` float32 logits, then a masked mean.

  With ``cast_logits`` the matmul returns logits in the input dtype and they
  are cast to float32 (what a Flax ``Dense(dtype=bfloat16)`` head followed by a
  float32 loss does): its backward runs its matmuls in the input dtype, where
  the float32-output version's autodiff promotes them to float32 (TF32 on a
  GPU). The table's ratios are against the faster of the two.
  """
  if cast_logits:
    logits = jnp.dot(hidden, weight.T).astype(jnp.float32)
  else:
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
  """Measures naive and each mst_jax impl; returns one row per implementation."""
  dtype = jnp.dtype(args.dtype)
  inputs = make_inputs(
    jax.random.key(args.seed),
    args.tokens,
    args.dim,
    args.vocab,
    dtype,
    args.masked_fraction,
  )

  def ours(impl):
    def loss(hidden, weight, labels, where):
      return mst_jax.linear_cross_entropy(
        hidden, weight, labels, where=where, chunk_size=args.chunk_size, impl=impl
      )

    return loss

  steps = {"naive": _step(naive_loss)}
  if dtype != jnp.float32:
    steps["naive_cast"] = _step(functools.partial(naive_loss, cast_logits=True))
  for impl in args.impl:
    steps[impl or "mst_jax"] = _step(ours(impl))
  results = {name: step(*inputs) for name, step in steps.items()}
  if jax.default_backend() == "gpu":
    warm_up()
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
  naive = min(
    (r for r in rows if r["impl"].startswith("naive")), key=lambda r: r["median_ms"]
  )
  header = (
    f"{'impl':<9} {'loss':>9} {'loss err':>9} {'dh err':>9} {'dw err':>9}"
    f" {'median ms':>10} {'TFLOP/s':>8} {'temp MiB':>9} {'time x':>7} {'mem x':>7}"
  )
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
      f"{r['impl']:<9} {r['loss']:>9.5f} {r['loss_rel_err']:>9.1e}"
      f" {r['dhidden_rel_err']:>9.1e} {r['dweight_rel_err']:>9.1e}"
      f" {r['median_ms']:>10.2f} {r['tflops']:>8.3f} {r['temp_mib']:>9.1f}"
      f" {r['median_ms'] / naive['median_ms']:>7.2f}"
      f" {r['temp_mib'] / max(naive['temp_mib'], 1e-9):>7.3f}"
    )
  return "\n".join(lines)


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


def copy_bandwidth(n_bytes: int = 2**32, reps: int = 50) -> float:
  """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
  x = jax.random.normal(jax.random.key(1), (n_bytes // 4,), jnp.float32)
  scale = jnp.float32(1.0001)  # an argument, so XLA cannot elide the pass
  fn = jax.jit(lambda x, s: x * s)
  return 2 * n_bytes / _mean_seconds_async(fn, (x, scale), reps)


def parse_blocks(text: str):
  """``"1x4096x8"`` (rows x block_v x warps[xstages]) -> ``KernelBlocks``."""
  from mst_jax.config import KernelBlocks

  fields = [int(f) for f in text.split("x")]
  return KernelBlocks(*fields)


def run_kernels(args: argparse.Namespace) -> list[dict]:
  """Per-chunk CE kernels alone: XLA against Pallas block configurations.

  For each chunk shape, times ``forward`` (statistics), ``backward`` (bf16
  dlogits) and ``forward_backward`` (fused) on float32 logits, and reports the
  bandwidth achieved against the floor: one read of the logits (forward), plus
  one write of dlogits (backward and fused).
  """
  from mst_jax import backends, ce_math
  from mst_jax.backends.pallas_triton import PallasTritonChunkCE

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
  parser.add_argument(
    "--impl",
    nargs="+",
    default=[None],
    type=lambda s: None if s == "auto" else s,
    help="mst_jax impls to compare with naive: auto, xla, pallas (default auto)",
  )
  parser.add_argument(
    "--masked-fraction",
    type=float,
    default=0.0,
    help="fraction of tokens excluded at random",
  )
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
  parser.add_argument(
    "--kernels",
    action="store_true",
    help="time the per-chunk CE kernels alone (XLA vs Pallas blocks) instead",
  )
  parser.add_argument(
    "--chunk-shapes",
    nargs="+",
    default=["1024x128256", "4096x128256", "1024x256000", "4096x256000"],
    help="with --kernels: chunk shapes ROWSxV",
  )
  parser.add_argument(
    "--blocks",
    nargs="+",
    default=["1x4096x8"],
    help="with --kernels: Pallas KernelBlocks ROWSxBLOCK_VxWARPS[xSTAGES]",
  )
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  device = jax.devices()[0]
  if args.kernels:
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
    run_kernels(args)
    return
  print(
    f"jax {jax.__version__} on {device.platform} ({device.device_kind});"
    f" N={args.tokens} D={args.dim} V={args.vocab} {args.dtype},"
    f" value_and_grad wrt hidden and weight"
  )
  print(format_table(run(args)))


if __name__ == "__main__":
  main()
