"""The Mosaic GPU GEMM against a float64 product, for the LM head's products.

Each case draws fresh random operands, multiplies them in float64 with numpy
and compares ``||out - ref|| / ||ref||`` with a tolerance keyed by the output
dtype (the kernel accumulates exact products in float32 and rounds once).
Sizes are deliberately not multiples of the kernel's tiles (1000 or 8000
rows, V = 32000 or 4160 columns, a contraction of 1000 rows), so every
partial tile is read with TMA's zero fill and stored clipped. The GPU cases
need a Hopper GPU; the argument checks and the lowering run everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._gemm.mosaic.config import (
  SMEM_BYTES,
  _fill,
  epilogue_slots,
  fit_shared_memory,
  narrow_error,
  ragged_error,
)
from mst_jax._gemm.mosaic.gemm import GemmConfig
from mst_jax._gemm.mosaic.kernels import gemm

# ||out - ref|| against the float64 product: at most ROUNDINGS x the error of
# that product rounded once to the output dtype (round to nearest even, as
# XLA's GEMMs write it), plus float32 accumulation over at most ~10^5 terms
# (ACCUMULATION x ||ref||). A 16-bit output stored by another rounding, or
# rounded twice, is 1.4x or more.
ROUNDINGS = 1.1
ACCUMULATION = 2e-5


def _check_rounding(out, ref, out_dtype, what):
  once = np.linalg.norm(np.asarray(jnp.asarray(ref, out_dtype), np.float64) - ref)
  error = np.linalg.norm(out - ref)
  allowed = ROUNDINGS * once + ACCUMULATION * np.linalg.norm(ref)
  assert error <= allowed, (*what, "error / one rounding's", error / once)


def _dims(lhs_dim: int, rhs_dim: int):
  return (((lhs_dim,), (rhs_dim,)), ((), ()))


# The head's products as (lhs, rhs, contracted dims) of hidden [N, D],
# dlogits [N, V] and the weight ("vd": [V, D], "dv": [D, V]), as in _gemm.matmul.
PRODUCTS = {
  ("logits", "vd"): ("hidden", "weight", _dims(1, 1)),
  ("logits", "dv"): ("hidden", "weight", _dims(1, 0)),
  ("dhidden", "vd"): ("dlogits", "weight", _dims(1, 0)),
  ("dhidden", "dv"): ("dlogits", "weight", _dims(1, 1)),
  ("dweight", "vd"): ("dlogits", "hidden", _dims(0, 0)),
  ("dweight", "dv"): ("hidden", "dlogits", _dims(0, 0)),
}
# (N, D, V): unaligned rows, and a 65 x 64-column vocabulary; 264 rows make
# dhidden six output tiles over V, which the default config splits along K
# (22 parts of 23 steps: the last one runs past V).
SHAPES = [(1000, 512, 4160), (8000, 256, 32000), (264, 320, 32000)]


def _operands(rng, n, d, v, layout, dtype):
  weight_shape = (v, d) if layout == "vd" else (d, v)
  return {
    "hidden": rng.standard_normal((n, d)),
    "dlogits": rng.standard_normal((n, v)),
    "weight": rng.standard_normal(weight_shape),
  }


def _run(rng, product, layout, shape, in_dtype, out_dtype, accumulate=False, **kw):
  lhs_name, rhs_name, dims = PRODUCTS[product, layout]
  arrays = {
    name: jnp.asarray(x, in_dtype)
    for name, x in _operands(rng, *shape, layout, in_dtype).items()
  }
  lhs, rhs = arrays[lhs_name], arrays[rhs_name]
  ref = jax.lax.dot_general(
    np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), dims
  )
  ref = np.asarray(ref)
  init = None
  if accumulate:
    init = jnp.asarray(rng.standard_normal(ref.shape), out_dtype)
    ref = ref + np.asarray(init, np.float64)
  out = mosaic_gemm.matmul(lhs, rhs, dims, out_dtype, accumulate=init, **kw)
  assert out.shape == ref.shape and out.dtype == jnp.dtype(out_dtype)
  out = np.asarray(out, np.float64)
  assert np.isfinite(out).all()
  _check_rounding(out, ref, out_dtype, (product, layout, shape))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("product,layout", list(PRODUCTS))
def test_head_products(rng, product, layout, shape, in_dtype):
  out_dtype = "float32" if product == "dweight" else in_dtype
  _run(rng, product, layout, shape, in_dtype, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "shape", [(1000, 512, 4160), (264, 320, 32000), (2104, 384, 16448)]
)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_dweight_accumulates(rng, layout, out_dtype, shape):
  """``dweight += dlogits^T hidden``, over a long and a short (264-row)
  contraction, into a float32 and a bfloat16 accumulator, with the default
  config: ping-pong tiles (over at most 512 rows, the whole addend loaded
  during the main loop)."""
  n, d, v = shape
  m, cols = (v, d) if layout == "vd" else (d, v)
  config = mosaic_gemm.default_config(m, cols, n, jnp.dtype(out_dtype), True)
  assert config.split == "tiles"
  _run(rng, "dweight", layout, shape, "bfloat16", out_dtype, True)


# Ping-pong configs: 128 x 128 and 128 x 192 tiles, and float32 partial
# products of a split contraction.
TURNS = [
  GemmConfig(split="tiles", stages=5, epilogue_n=32),
  GemmConfig(split="tiles", tile_n=192, stages=4, epilogue_n=32),
  GemmConfig(split="tiles", k_splits=3, epilogue_n=32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", TURNS, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("product,layout", list(PRODUCTS))
def test_warpgroups_take_tiles_in_turn(rng, product, layout, shape, config):
  """``split="tiles"``: each compute warpgroup owns whole output tiles, in
  turn. The shapes give blocks an odd and an even number of tiles (up to
  120), and blocks with one tile or none."""
  out_dtype = "float32" if product == "dweight" else "bfloat16"
  _run(rng, product, layout, shape, "bfloat16", out_dtype, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", TURNS[:2], ids=str)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_warpgroups_take_tiles_in_turn_accumulating(rng, layout, out_dtype, config):
  shape = (1000, 512, 4160)
  _run(rng, "dweight", layout, shape, "bfloat16", out_dtype, True, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_an_addend_slot_for_every_piece(rng, layout):
  """More epilogue slots than two (one per 64 x 128 piece of 192 x 128
  tiles): each piece's addend loads ahead, none after a store."""
  config = GemmConfig(
    split="tiles", tile_m=192, tile_n=128, stages=3, epilogue_n=128, epilogue_buffers=3
  )
  assert epilogue_slots(config) == 3
  _run(
    rng,
    "dweight",
    layout,
    (264, 512, 4160),
    "bfloat16",
    "bfloat16",
    True,
    config=config,
  )


@pytest.mark.parametrize("rows", [128, 256, 384])
def test_small_chunk_gemms_in_whole_blocks(rows):
  """A chunk of a few hundred rows' logits and dhidden: blocks of rows that
  divide the chunk, so no block is partly idle."""
  bf16 = jnp.dtype(jnp.bfloat16)
  for d, v in [(4096, 128256), (2304, 256000)]:
    logits = mosaic_gemm.default_config(rows, v, d, bf16, False)
    dhidden = mosaic_gemm.default_config(rows, d, v, bf16, False)
    assert rows % logits.block_m == 0 and rows % dhidden.block_m == 0
    assert dhidden.k_splits > 1  # a few output tiles over a long contraction


def test_long_contraction_blocks_fill_the_waves():
  """dhidden over K = V: Gemma-2's 4096-row group in 128 x 192 blocks that
  fill the SMs' waves without float32 partial products (256 x 128 blocks
  leave the third wave 82% idle, or need a 3-way split); Llama-3's 8192 rows
  fill them in the table's blocks."""
  bf16 = jnp.dtype(jnp.bfloat16)
  gemma = mosaic_gemm.default_config(4096, 2304, 256000, bf16, False)
  assert gemma.k_splits == 1 and _fill(4096, 2304, gemma, 132) > 0.95
  llama = mosaic_gemm.default_config(8192, 4096, 128256, bf16, False)
  assert llama.k_splits == 1 and _fill(8192, 4096, llama, 132) > 0.95


@pytest.mark.parametrize(
  "rows,d,v", [(512, 4096, 128256), (4096, 2304, 256000), (8192, 4096, 128256)]
)
def test_walk_rows_first_while_an_operand_fits_l2(rows, d, v):
  """The logits and the "vd" dweight of a chunk whose hidden fits in L2
  (32 MiB) walk the output down its rows first, so each tile of the other
  operand (the weight, dlogits) is read from memory once."""
  bf16, fits = jnp.dtype(jnp.bfloat16), rows * d * 2 <= 32 << 20
  logits = mosaic_gemm.default_config(rows, v, d, bf16, False)
  dweight = mosaic_gemm.default_config(v, d, rows, bf16, True)
  assert logits.grid_minor == dweight.grid_minor == ("m" if fits else "n")


@pytest.mark.gpu
def test_dhidden_in_narrow_blocks(rng):
  """A dhidden that the default config computes in 128 x 192 blocks without
  a split, against float64."""
  shape = (1000, 2304, 16448)
  config = mosaic_gemm.default_config(1000, 2304, 16448, jnp.dtype(jnp.bfloat16), False)
  assert (config.block_m, config.block_n, config.k_splits) == (128, 192, 1)
  _run(rng, "dhidden", "vd", shape, "bfloat16", "bfloat16")


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_short_contractions_take_tiles_in_turn(accumulate, out_dtype):
  """dweight over a chunk or a group of rows (both layouts, Llama-3 and
  Gemma-2), and a chunk's logits, run ping-pong; a whole group's logits and
  dhidden (K = V) keep both warpgroups on each tile, as does the "dv"
  dweight of 8192 rows, whose shape is such a group's logits."""
  dtype = jnp.dtype(out_dtype)
  config = lambda m, n, k: mosaic_gemm.default_config(m, n, k, dtype, accumulate)
  for rows in (256, 1024, 4096, 8192):
    for d, v in [(4096, 128256), (2304, 256000)]:
      assert config(v, d, rows).split == "tiles"  # dweight, "vd"
      dv_turns = accumulate or rows < 8192
      assert (config(d, v, rows).split == "tiles") == dv_turns  # dweight, "dv"
      assert config(rows, d, v).split != "tiles"  # dhidden
  if not accumulate:
    assert config(1024, 128256, 4096).split == "tiles"
    assert config(8192, 128256, 4096).split != "tiles"


@pytest.mark.parametrize("rows", [192, 256, 512, 513, 1024])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16", "float32"])
def test_a_short_dweight_loads_its_whole_addend_ahead(rows, out_dtype):
  """A chunk's dweight += over at most 512 rows (a 16-bit accumulator) gives
  each epilogue piece its own slot, so the whole addend tile loads during the
  main loop; longer contractions and float32 accumulators keep the other
  tiles. Both fit shared memory."""
  dtype = jnp.dtype(out_dtype)
  config = mosaic_gemm.default_config(128256, 4096, rows, dtype, True)
  pieces = (config.tile_m // config.epilogue_m) * (config.tile_n // config.epilogue_n)
  ahead = rows <= 512 and dtype.itemsize == 2
  assert (epilogue_slots(config) == pieces) == ahead, config
  assert config.split == "tiles"
  assert config.smem_bytes(jnp.bfloat16, dtype, True) <= SMEM_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize(
  "config",
  [
    GemmConfig(split="n"),
    GemmConfig(tile_n=192, stages=3, grid_minor="m", grid_tile_width=4),
    GemmConfig(tile_m=64, tile_n=256),
    GemmConfig(tile_k=128, stages=2),
    GemmConfig(k_splits=3, epilogue_n=32),  # float32 partial products
  ],
  ids=str,
)
@pytest.mark.parametrize("product,layout", [("logits", "vd"), ("dweight", "vd")])
def test_configs(rng, product, layout, config):
  _run(rng, product, layout, (1000, 512, 4160), "bfloat16", "bfloat16", config=config)


@pytest.mark.gpu
def test_dhidden_split_to_fill_the_last_wave(rng):
  """A dhidden of fewer output blocks than fill the SMs' waves (2048 x 2304
  over K = 16448: 192 blocks of 128 x 192 on 132 SMs leave the second wave
  half idle): the default config splits K so they fill it, and the float32
  parts sum right."""
  shape = (2048, 2304, 16448)
  config = mosaic_gemm.default_config(2048, 2304, 16448, jnp.dtype(jnp.bfloat16), False)
  assert config.k_splits > 1 and _fill(2048, 2304, config, 132) > 0.95
  _run(rng, "dhidden", "vd", shape, "bfloat16", "bfloat16")


# Ragged arrays (rows not a multiple of 8: a [V, D] weight with V = 1001 or
# GPT-2's 50257, or 1001 rows of hidden), with the head's products over a
# dlogits and logits padded to whole 64-column tiles (``Vp``) as
# ``mst_jax._gemm.matmul`` forms them: the logits written past V as zeros, the
# weight read as zero-extended to Vp rows for dhidden, dweight only V rows.
RAGGED = [(1000, 512, 1001), (264, 768, 50257), (1001, 256, 1001)]
# dweight contracts over the rows, which must be whole tiles of 8 (the
# driver appends rows to an unaligned N: ``_plan.tma_row_padding``).
RAGGED_CASES = [
  (product, shape)
  for product in ("logits", "dhidden", "dweight")
  for shape in RAGGED
  if product != "dweight" or shape[0] % 8 == 0
]


def _run_ragged(rng, product, shape, in_dtype, out_dtype, accumulate=True):
  n, d, v = shape
  vp = -(-v // 64) * 64
  hidden = rng.standard_normal((n, d))
  weight = rng.standard_normal((v, d))
  dlogits = rng.standard_normal((n, vp))  # its pad columns count for nothing
  init = None
  if product == "logits":
    lhs, rhs, dims, kw = hidden, weight, _dims(1, 1), dict(out_shape=(n, vp))
  elif product == "dhidden":
    lhs, rhs, dims, kw = dlogits, weight, _dims(1, 0), dict(zero_extend=True)
  else:
    lhs, rhs, dims, kw = dlogits, hidden, _dims(0, 0), dict(out_shape=(v, d))
    if accumulate:
      init = jnp.asarray(rng.standard_normal((v, d)), out_dtype)
  lhs, rhs = (jnp.asarray(x, in_dtype) for x in (lhs, rhs))
  a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  if product == "logits":
    ref = np.concatenate([a @ b.T, np.zeros((n, vp - v))], axis=1)
  elif product == "dhidden":
    ref = a[:, :v] @ b
  else:
    ref = a[:, :v].T @ b + (0.0 if init is None else np.asarray(init, np.float64))
  out = mosaic_gemm.matmul(lhs, rhs, dims, out_dtype, accumulate=init, **kw)
  assert out.shape == ref.shape and out.dtype == jnp.dtype(out_dtype)
  out = np.asarray(out, np.float64)
  assert np.isfinite(out).all()
  if product == "logits":
    assert (out[:, v:] == 0).all()
  _check_rounding(out, ref, out_dtype, (product, shape))


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("product,shape", RAGGED_CASES)
def test_ragged_arrays(rng, product, shape, in_dtype):
  """Arrays of a number of rows that is not a multiple of 8, which TMA
  copies a row at a time, against float64; dweight accumulated into
  float32 and into the inputs' dtype."""
  out_dtype = "float32" if product == "dweight" else in_dtype
  _run_ragged(rng, product, shape, in_dtype, out_dtype)
  if product == "dweight":
    _run_ragged(rng, product, shape, in_dtype, in_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_ragged_output_split_along_k(rng, out_dtype):
  """A first dweight (no addend) of a 1105-column vocabulary block over 4096
  rows: its default config splits the contraction, whose float32 partial
  products go through the ragged output's epilogue."""
  problem = mosaic_gemm._check(
    jax.ShapeDtypeStruct((4096, 1152), jnp.bfloat16),
    jax.ShapeDtypeStruct((4096, 768), jnp.bfloat16),
    _dims(0, 0),
    out_dtype,
    None,
    out_shape=(1105, 768),
  )
  assert mosaic_gemm._config(problem).k_splits > 1
  _run_ragged(rng, "dweight", (4096, 768, 1105), "bfloat16", out_dtype, False)


@pytest.mark.gpu
def test_logits_in_float32(rng):
  _run(rng, "logits", "dv", (1000, 512, 4160), "bfloat16", "float32")


BOUNDED_CONFIGS = [None, TURNS[0], GemmConfig(split="n"), TURNS[2]]


@pytest.mark.gpu
@pytest.mark.parametrize("config", BOUNDED_CONFIGS, ids=str)
@pytest.mark.parametrize("bound", [1, 64, 437, 1000])
@pytest.mark.parametrize("product,layout", list(PRODUCTS))
def test_a_bound_cuts_the_rows(rng, product, layout, bound, config):
  """``bound`` on the rows of a block (1000 rows): the logits and ``dhidden``
  match the product before it (``bounded="m"``), and ``dweight`` (``"k"``,
  accumulated) is the product over the rows before the first multiple of 64
  at or past it, the rows from there on of both operands NaN: never read."""
  n, d, v = 1000, 512, 4160
  if config is not None and config.k_splits > 1 and product == "dweight":
    config = None  # an accumulated product is not split
  lhs_name, rhs_name, dims = PRODUCTS[product, layout]
  arrays = _operands(rng, n, d, v, layout, "bfloat16")
  read = -(-bound // 64) * 64
  if product == "dweight":
    for name in ("hidden", "dlogits"):
      arrays[name][read:] = np.nan
  lhs, rhs = (jnp.asarray(arrays[name], jnp.bfloat16) for name in (lhs_name, rhs_name))
  rows = slice(None, read) if product == "dweight" else slice(None)
  cut = lambda name: np.asarray(
    jnp.asarray(arrays[name][rows], jnp.bfloat16), np.float64
  )
  ref = np.asarray(jax.lax.dot_general(cut(lhs_name), cut(rhs_name), dims))
  init, bounded = None, "m"
  if product == "dweight":
    init = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
    ref, bounded = ref + np.asarray(init, np.float64), "k"
  out_dtype = "float32" if product == "dweight" else "bfloat16"
  if config is not None:  # as the GEMM fits its own configs
    config = fit_shared_memory(config, out_dtype, init is not None)
  out = mosaic_gemm.matmul(
    lhs,
    rhs,
    dims,
    jnp.dtype(out_dtype),
    accumulate=init,
    config=config,
    bound=jnp.int32(bound),
    bounded=bounded,
  )
  out = np.asarray(out, np.float64)
  if bounded == "m":
    out, ref = out[:bound], ref[:bound]
  assert np.isfinite(out).all()
  _check_rounding(out, ref, out_dtype, (product, layout, bound))


def test_rejects_bad_arguments():
  x = jnp.zeros((64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="contracted dimensions differ"):
    mosaic_gemm.matmul(x, x, _dims(1, 0))
  with pytest.raises(TypeError, match="bfloat16 or float16"):
    mosaic_gemm.matmul(x.astype(jnp.float32), x, _dims(1, 1))
  with pytest.raises(TypeError, match="out_dtype"):
    mosaic_gemm.matmul(x, x, _dims(1, 1), jnp.int32)
  with pytest.raises(ValueError, match="accumulate has shape"):
    mosaic_gemm.matmul(x, x, _dims(1, 1), accumulate=x)
  # GPT-2's vocabulary: rows of 50257 bf16 are not whole 128-byte tiles.
  odd = jnp.zeros((64, 50257), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="lax.dot_general"):
    mosaic_gemm.matmul(odd, jnp.zeros((50257, 64), jnp.bfloat16), _dims(1, 0))
  # Contracted over 1001 rows: TMA would copy [tile_k, block] tiles of one row.
  ragged = jnp.zeros((1001, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="contracted over a number of rows"):
    mosaic_gemm.matmul(ragged, ragged, _dims(0, 0))
  with pytest.raises(ValueError, match="contracted dimensions differ"):
    mosaic_gemm.matmul(x, jnp.zeros((192, 64), jnp.bfloat16), _dims(1, 0))
  with pytest.raises(ValueError, match="bounded must be one of"):
    mosaic_gemm.matmul(x, x, _dims(1, 1), bound=jnp.int32(8), bounded="n")
  with pytest.raises(ValueError, match="given with a bound"):
    mosaic_gemm.matmul(x, x, _dims(1, 1), bounded="m")


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("product,layout", list(PRODUCTS))
def test_a_64_wide_output_is_stored_from_64_wide_blocks(product, layout, out_dtype):
  """A head with D = 64: an output one swizzle span wide (``[N, 64]`` or
  ``[V, 64]`` in 16 bits) is stored from 64-column blocks by default, and a
  config with wider blocks is refused, not run (they stored zeros on the
  H200)."""
  S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  n, d, v = 1000, 64, 4160
  shapes = {"hidden": (n, d), "dlogits": (n, v)}
  shapes["weight"] = (v, d) if layout == "vd" else (d, v)
  lhs_name, rhs_name, dims = PRODUCTS[product, layout]
  lhs, rhs = S(shapes[lhs_name], bf16), S(shapes[rhs_name], bf16)
  problem = mosaic_gemm._check(lhs, rhs, dims, out_dtype, None)
  config = mosaic_gemm._config(problem)
  assert narrow_error(config, problem) is None
  one_span = problem.n * jnp.dtype(out_dtype).itemsize <= 128
  if one_span and config.k_splits == 1:
    assert config.block_n == 64
    wide = dataclasses.replace(config, tile_n=192)
    assert narrow_error(wide, problem) is not None
    with pytest.raises(ValueError, match="does not fit"):
      gemm(
        jnp.zeros(lhs.shape, bf16), jnp.zeros(rhs.shape, bf16), None, problem, wide, 132
      )
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
    product_of = lambda a, b: mosaic_gemm.matmul(a, b, dims, out_dtype)
    text = jax.jit(product_of).trace(lhs, rhs).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in text.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
  "product,layout,accumulate",
  [(*key, False) for key in PRODUCTS]
  + [("dweight", "vd", True), ("dweight", "dv", True)],
)
def test_a_64_wide_hidden_size(rng, product, layout, accumulate, out_dtype):
  """Every product of a head with D = 64 (unaligned N and V), in each
  output dtype, and ``dweight`` with an addend, with the default config."""
  _run(rng, product, layout, (1000, 64, 4160), "bfloat16", out_dtype, accumulate)


@pytest.mark.skipif(has_gpu(), reason="checks the CPU's refusal")
def test_needs_a_hopper_gpu():
  x = jnp.zeros((128, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Hopper"):
    mosaic_gemm.matmul(x, x, _dims(1, 1))


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(tile_m=96),
    dict(tile_m=256, tile_n=128),
    dict(split="k"),
    dict(stages=0),
    dict(split="tiles", stages=1),
    dict(epilogue_buffers=0),
  ],
  ids=str,
)
def test_config_validation(kwargs):
  with pytest.raises(ValueError, match="GemmConfig"):
    GemmConfig(**kwargs)


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_default_config_fits_shared_memory(out_dtype, accumulate):
  shapes = [(8192, 128256, 4096), (128256, 4096, 8192), (8192, 4096, 256000)]
  for m, n, k in shapes + [(256, 128256, 4096), (384, 256000, 2304)]:
    config = mosaic_gemm.default_config(m, n, k, jnp.dtype(out_dtype), accumulate)
    smem = config.smem_bytes(jnp.bfloat16, jnp.dtype(out_dtype), accumulate)
    assert smem <= 227 * 1024


@pytest.mark.parametrize(
  "n,d,v", [(1000, 256, 4160), (8192, 4096, 128256), (264, 320, 32000)]
)
@pytest.mark.parametrize("product,layout", list(PRODUCTS))
def test_lowers_for_hopper(product, layout, n, d, v):
  """Each product lowers to a Mosaic GPU kernel (Python passes only; no GPU),
  with the default config of a small and of the Llama-3 head's shape."""
  shapes = {"hidden": (n, d), "dlogits": (n, v)}
  shapes["weight"] = (v, d) if layout == "vd" else (d, v)
  lhs_name, rhs_name, dims = PRODUCTS[product, layout]
  lhs = jax.ShapeDtypeStruct(shapes[lhs_name], jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct(shapes[rhs_name], jnp.bfloat16)
  out_dtype = jnp.dtype(jnp.float32 if product == "dweight" else jnp.bfloat16)
  problem = mosaic_gemm._check(lhs, rhs, dims, out_dtype, None)
  config = mosaic_gemm.default_config(problem.m, problem.n, problem.k, out_dtype, False)
  if n == 8192:  # the Llama-3 head's outputs fill the SMs
    assert config.k_splits == 1
  elif (n, product) == (264, "dhidden"):
    assert config.k_splits == 22
  fn = jax.jit(lambda a, b: gemm(a, b, None, problem, config, num_sms=132))
  text = fn.trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_accumulating_dweight_lowers_for_hopper(layout, out_dtype):
  """``dweight +=`` over a 1024-row chunk of the Llama-3 head lowers with its
  default (ping-pong) config, the addend loaded through the epilogue slots."""
  n, d, v = 1024, 4096, 128256
  lhs_name, rhs_name, dims = PRODUCTS["dweight", layout]
  shapes = {"hidden": (n, d), "dlogits": (n, v)}
  lhs = jax.ShapeDtypeStruct(shapes[lhs_name], jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct(shapes[rhs_name], jnp.bfloat16)
  out_dtype = jnp.dtype(out_dtype)
  acc = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), out_dtype)
  problem = mosaic_gemm._check(lhs, rhs, dims, out_dtype, acc)
  config = mosaic_gemm.default_config(problem.m, problem.n, problem.k, out_dtype, True)
  assert config.split == "tiles"
  fn = jax.jit(lambda a, b, c: gemm(a, b, c, problem, config, num_sms=132))
  text = fn.trace(lhs, rhs, acc).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("product,shape", RAGGED_CASES)
def test_ragged_arrays_lower_for_hopper(product, shape):
  """The ragged products lower (Python passes only; no GPU), with default
  configs that ``ragged_error`` accepts."""
  n, d, v = shape
  vp = -(-v // 64) * 64
  S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  if product == "logits":
    args, dims, out_dtype = (S((n, d), bf16), S((v, d), bf16)), _dims(1, 1), bf16
    kw = dict(out_shape=(n, vp))
  elif product == "dhidden":
    args, dims, out_dtype = (S((n, vp), bf16), S((v, d), bf16)), _dims(1, 0), bf16
    kw = dict(zero_extend=True)
  else:
    out_dtype = jnp.float32
    args = (S((n, vp), bf16), S((n, d), bf16), S((v, d), out_dtype))
    dims, kw = _dims(0, 0), dict(out_shape=(v, d))
  problem = mosaic_gemm._check(*args[:2], dims, out_dtype, *args[2:] or [None], **kw)
  assert any(problem.ragged)
  assert ragged_error(mosaic_gemm._config(problem), problem) is None

  def product_of(lhs, rhs, acc=None):
    return mosaic_gemm.matmul(lhs, rhs, dims, out_dtype, accumulate=acc, **kw)

  with_hopper = pytest.MonkeyPatch.context()
  with with_hopper as patch:
    patch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
    text = jax.jit(product_of).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in text.as_text()


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_ragged_output_split_along_k_stores_float32_pieces(out_dtype):
  """Split along K, the kernel stores float32 partial products: a ragged
  output's epilogue pieces are one swizzle span of float32 (32 columns),
  whatever the output dtype; the product lowers."""
  S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  args = (S((4096, 1152), bf16), S((4096, 768), bf16))
  problem = mosaic_gemm._check(*args, _dims(0, 0), out_dtype, None, (1105, 768))
  config = mosaic_gemm._config(problem)
  assert config.k_splits > 1 and config.epilogue_n == 32
  assert ragged_error(config, problem) is None
  assert ragged_error(dataclasses.replace(config, epilogue_n=64), problem)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
    product = lambda a, b: mosaic_gemm.matmul(
      a, b, _dims(0, 0), out_dtype, out_shape=(1105, 768)
    )
    text = jax.jit(product).trace(*args).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in text.as_text()


def test_ragged_arrays_need_row_copies():
  """A config that cannot copy ragged arrays is refused, not run."""
  S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  problem = mosaic_gemm._check(
    S((264, 1024), bf16),
    S((1001, 256), bf16),
    _dims(1, 0),
    bf16,
    None,
    zero_extend=True,
  )
  assert problem.ragged == (False, True, False)
  for config in (GemmConfig(split="m"), GemmConfig(split="tiles", tile_n=128)):
    assert ragged_error(config, problem) is not None
    with pytest.raises(ValueError, match="does not fit"):
      gemm(
        jnp.zeros((264, 1024), bf16),
        jnp.zeros((1001, 256), bf16),
        None,
        problem,
        config,
        num_sms=132,
      )
