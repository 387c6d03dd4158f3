"""The kernels alone: the per-chunk CE kernels, and the head's three GEMMs.

``run_kernels``: for each chunk shape, times ``forward`` (statistics),
``backward`` (bf16 dlogits) and ``forward_backward`` (fused) on float32 or
bfloat16 logits, XLA against Pallas Triton block configurations and (16-bit
logits) Mosaic GPU tiles, and reports the bandwidth achieved against the
floor: one read of the logits (forward), plus one write of dlogits (backward
and fused), and against the device-to-device copy bandwidth measured in the
same run. On bfloat16 logits the kernels write ``dlogits`` over them, as in
a step: each timed call's ``dlogits`` are the next call's logits, so no copy
of an input that is still needed is timed.

``run_gemms``: for each head shape and weight layout, times the logits,
``dhidden`` and ``dweight`` GEMMs (bfloat16 operands, float32 accumulation)
through XLA (``lax.dot_general`` with ``preferred_element_type``) and through
the Mosaic GPU kernel (``mst_jax._gemm.mosaic.gemm``), side by side in TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import _kernels as backends
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.mosaic.ce import MosaicBlocks, MosaicChunkCE
from mst_jax._kernels.triton.ce import KernelBlocks, PallasTritonChunkCE
from mst_jax._math import ce as ce_math


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


def _mean_seconds_chained(fn, logits, others, reps: int) -> float:
  """Mean time of ``reps`` calls of ``fn(logits, *others) -> dlogits``, each
  on the last one's ``dlogits`` (written over their logits where the kernel
  does), in one jitted loop."""
  loop = jax.jit(
    lambda lg, *o: lax.fori_loop(0, reps, lambda _, x: fn(x, *o), lg),
    donate_argnums=0,
  )
  jax.block_until_ready(loop(jnp.copy(logits), *others))
  start = time.perf_counter()
  jax.block_until_ready(loop(jnp.copy(logits), *others))
  return (time.perf_counter() - start) / reps


def parse_blocks(text: str) -> KernelBlocks:
  """``"1x4096x8"`` (rows x block_v x warps[xstages]) -> ``KernelBlocks``."""
  fields = [int(f) for f in text.split("x")]
  return KernelBlocks(*fields)


def parse_tiles(text: str) -> MosaicBlocks:
  """``"128x2x1056"`` (block_v x stages x programs) -> ``MosaicBlocks``."""
  block_v, stages, programs = (int(f) for f in text.split("x"))
  return MosaicBlocks(block_v=block_v, stages=stages, programs=programs)


def run_kernels(args: argparse.Namespace) -> list[dict]:
  """Times every pass of every backend on every chunk shape; prints as it goes."""
  warm_up()
  bandwidth = copy_bandwidth()
  print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")
  options = ce_math.CEOptions()
  interpret = jax.default_backend() != "gpu"
  impls = {"xla": backends.XlaChunkCE()}
  for text in args.blocks:
    impls[f"pallas {text}"] = PallasTritonChunkCE(
      blocks=parse_blocks(text), interpret=interpret
    )
  dtype = jnp.dtype(args.logits_dtype)
  if args.mosaic_tiles and dtype.itemsize != 2:
    print("--mosaic-tiles: the Mosaic kernels take 16-bit logits; skipped")
  elif args.mosaic_tiles and not interpret and mosaic_gemm.unavailable_reason():
    print(f"--mosaic-tiles: skipped, {mosaic_gemm.unavailable_reason()}")
  else:
    for text in args.mosaic_tiles:
      impls[f"mosaic {text}"] = MosaicChunkCE(
        tiles=parse_tiles(text), interpret=interpret
      )
  rows = []
  for shape in args.chunk_shapes:
    n_rows, vocab = (int(f) for f in shape.split("x"))
    key = jax.random.key(args.seed)
    logits = (3.0 * jax.random.normal(key, (n_rows, vocab), jnp.float32)).astype(dtype)
    labels = jax.random.randint(key, (n_rows,), 0, vocab)
    valid = jnp.ones((n_rows,), bool)
    g_loss = jnp.full((n_rows,), 1.0 / n_rows, jnp.float32)
    logit_bytes, dlogit_bytes = n_rows * vocab * dtype.itemsize, n_rows * vocab * 2
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    back_rows = ce_math.backward_rows(
      g_loss, jnp.zeros_like(lse), lse, labels, valid, options, vocab
    )
    in_place = dtype == jnp.bfloat16  # dlogits (bf16) over the logits
    for name, backend in impls.items():
      # pass: (fn(logits, *others), others, floor bytes, returns dlogits)
      passes = {
        "forward": (
          lambda lg, y, b=backend: b.forward(lg, y, options),
          (labels,),
          logit_bytes,
          False,
        ),
        "backward": (
          lambda lg, y, r, b=backend: b.backward(lg, y, r, options, jnp.bfloat16),
          (labels, back_rows),
          logit_bytes + dlogit_bytes,
          True,
        ),
        "fused": (
          lambda lg, y, v, g, b=backend: b.forward_backward(
            lg, y, v, g, options, jnp.bfloat16
          )[1],
          (labels, valid, g_loss),
          logit_bytes + dlogit_bytes,
          True,
        ),
      }
      for pass_name, (fn, others, floor_bytes, chained) in passes.items():
        if in_place and chained:
          seconds = _mean_seconds_chained(fn, logits, others, args.reps)
        else:
          seconds = _mean_seconds_async(jax.jit(fn), (logits, *others), args.reps)
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


# (N, D, V) of the heads the GEMM report times: whole heads, and the products
# of one chunk or group as the low-memory settings and Gemma-2's plan form them.
GEMM_HEADS = {
  "llama": (8192, 4096, 128256),
  "gemma": (8192, 2304, 256000),
  "llama_192": (192, 4096, 128256),
  "llama_256": (256, 4096, 128256),
  "llama_384": (384, 4096, 128256),
  "llama_512": (512, 4096, 128256),
  "llama_1024": (1024, 4096, 128256),
  "gemma_4096": (4096, 2304, 256000),
}


def _dims(lhs_dim: int, rhs_dim: int):
  return (((lhs_dim,), (rhs_dim,)), ((), ()))


# Per (product, layout): lhs, rhs (of hidden [N, D], dlogits [N, V] and the
# weight), contracted dimensions, output dtype, whether it adds into an
# accumulator of that dtype. The products of mst_jax._gemm.matmul.
GEMM_PRODUCTS = {
  ("logits", "vd"): ("hidden", "weight", _dims(1, 1), jnp.bfloat16, False),
  ("logits", "dv"): ("hidden", "weight", _dims(1, 0), jnp.bfloat16, False),
  ("dhidden", "vd"): ("dlogits", "weight", _dims(1, 0), jnp.bfloat16, False),
  ("dhidden", "dv"): ("dlogits", "weight", _dims(1, 1), jnp.bfloat16, False),
  ("dweight", "vd"): ("dlogits", "hidden", _dims(0, 0), jnp.bfloat16, False),
  ("dweight", "dv"): ("hidden", "dlogits", _dims(0, 0), jnp.bfloat16, False),
  ("dweight+=f32", "vd"): ("dlogits", "hidden", _dims(0, 0), jnp.float32, True),
  ("dweight+=f32", "dv"): ("hidden", "dlogits", _dims(0, 0), jnp.float32, True),
  ("dweight+=bf16", "vd"): ("dlogits", "hidden", _dims(0, 0), jnp.bfloat16, True),
  ("dweight+=bf16", "dv"): ("hidden", "dlogits", _dims(0, 0), jnp.bfloat16, True),
}


def parse_gemm_config(text: str) -> mosaic_gemm.GemmConfig:
  """``"tile_n=192,stages=3,split=n"`` -> ``GemmConfig`` (other fields default)."""
  fields = {f.name: f.type for f in dataclasses.fields(mosaic_gemm.GemmConfig)}
  kwargs = {}
  for item in text.split(","):
    name, value = item.split("=")
    kwargs[name] = value if fields[name] == "str" else int(value)
  return mosaic_gemm.GemmConfig(**kwargs)


def gemm_fns(dims, out_dtype, accumulate: bool, configs) -> dict:
  """``impl name -> jitted fn(lhs, rhs[, acc])``: XLA, then each Mosaic config."""
  if accumulate:
    xla = lambda a, b, c: (
      c + lax.dot_general(a, b, dims, preferred_element_type=c.dtype)
    )
    mosaic = lambda a, b, c, config: mosaic_gemm.matmul(
      a, b, dims, c.dtype, accumulate=c, config=config
    )
  else:
    xla = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
    mosaic = lambda a, b, config: mosaic_gemm.matmul(
      a, b, dims, out_dtype, config=config
    )
  donate = (2,) if accumulate else ()
  fns = {"xla": jax.jit(xla, donate_argnums=donate)}
  for name, config in configs.items():
    fn = lambda *args, config=config: mosaic(*args, config=config)
    fns[name] = jax.jit(fn, donate_argnums=donate)
  return fns


def _time_gemm(fn, lhs, rhs, acc, reps: int) -> float:
  """Mean seconds of ``reps`` dispatches; an accumulator is carried (donated)."""
  if acc is None:
    return _mean_seconds_async(fn, (lhs, rhs), reps)
  acc = jax.block_until_ready(fn(lhs, rhs, acc))
  start = time.perf_counter()
  for _ in range(reps):
    acc = fn(lhs, rhs, acc)
  jax.block_until_ready(acc)
  return (time.perf_counter() - start) / reps


@jax.jit
def _relative_difference(x, y):
  return jnp.linalg.norm(x - y) / jnp.linalg.norm(y)


def run_gemms(args: argparse.Namespace) -> list[dict]:
  """Times every head GEMM through XLA and Mosaic; prints as it goes."""
  warm_up()
  configs = {"mosaic": None}
  configs.update({f"mosaic {t}": parse_gemm_config(t) for t in args.gemm_configs})
  rows = []
  for head in args.gemm_heads:
    n, d, v = GEMM_HEADS[head]
    keys = jax.random.split(jax.random.key(args.seed), 3)
    arrays = {
      "hidden": jax.random.normal(keys[0], (n, d), jnp.bfloat16),
      "dlogits": jax.random.normal(keys[1], (n, v), jnp.bfloat16),
    }
    for layout in args.gemm_layouts:
      shape = (v, d) if layout == "vd" else (d, v)
      arrays["weight"] = jax.random.normal(keys[2], shape, jnp.bfloat16)
      for (product, product_layout), spec in GEMM_PRODUCTS.items():
        if product_layout != layout or product.split("+")[0] not in args.gemm_products:
          continue
        lhs_name, rhs_name, dims, out_dtype, accumulate = spec
        lhs, rhs = arrays[lhs_name], arrays[rhs_name]
        reference = None
        for impl, fn in gemm_fns(dims, out_dtype, accumulate, configs).items():
          row = {"head": head, "layout": layout, "product": product, "impl": impl}
          acc = None
          if accumulate:
            out_shape = (d, v) if lhs_name == "hidden" else (v, d)
            acc = jnp.zeros(out_shape, out_dtype)
          try:
            seconds = _time_gemm(fn, lhs, rhs, acc, args.reps)
          except Exception as e:  # noqa: BLE001 -- report the failure, time the rest
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{head:>6} {layout} {product:<13} {impl:<30} {row['error']}")
            rows.append(row)
            continue
          row.update(ms=seconds * 1e3, tflops=2 * n * d * v / seconds / 1e12)
          if not accumulate:  # against XLA's output (the first impl)
            out = fn(lhs, rhs).astype(jnp.float32)
            reference = out if reference is None else reference
            row["vs_xla"] = float(_relative_difference(out, reference))
          rows.append(row)
          print(
            f"{head:>6} {layout} {product:<13} {impl:<30} {row['ms']:8.3f} ms"
            f" {row['tflops']:6.1f} TFLOP/s  vs xla {row.get('vs_xla', 0):.1e}",
            flush=True,
          )
    del arrays
  return rows
