"""Heuristics: how many rows a chunk and a group of chunks hold, per memory
budget; how ``dweight`` accumulates; how float16 gradients are scaled."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

# The chunk temporaries (a group's logits, overwritten by its dlogits, and a
# chunk's; or a chunk's float32 logits and a group's dlogits) stay under this
# many bytes by default: 8192 rows of the Llama-3 head's bfloat16 logits.
DEFAULT_MEMORY_BUDGET = 9 << 28  # 2.25 GiB

# A partially valid group (logits in the compute dtype) goes in this many chunks.
CHUNKS_PER_GROUP = 8

# On XLA:CPU (compiled from shapes, jax 0.10): the matmuls go in tiles of this
# many vocabulary columns (``matmul_tile``), and the cross-entropy's
# reductions read a float32 copy of a chunk's logits, this many bytes a logit.
MATMUL_TILE = 4096
CPU_COPY_BYTES = 4
# ... unless whole-weight float32 temporaries take at most this share of the budget.
UNTILED_SHARE = 8
# A bias is added to float32 logits, then rounded to 16-bit ones
# (``_gemm.matmul.logits_matmul``): the float32 product, this many bytes a logit,
# is held beside them.
BIAS_BYTES = 4

# Tensor cores want row counts in multiples of this.
_ROW_ALIGN = 128

# The Mosaic GPU kernels move rows in TMA tiles of this many
# (``mst_jax._gemm.mosaic.gemm``): they take blocks of rows in multiples of it.
TMA_ROWS = 8


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def matmul_tile(platform: str, vocab: int, dim: int, memory_budget: int) -> int | None:
  """Vocabulary columns per matmul tile (``HeadSpec.matmul_tile``), or None.

  XLA:CPU converts a whole 16-bit ``[V, D]`` operand to float32 for a
  matmul, and adds a ``dweight`` product to its accumulator from a whole
  ``[V, D]`` float32 temporary (2 GiB at the Llama-3 head): where those two
  would take more than ``1 / UNTILED_SHARE`` of the budget, the matmuls go one
  tile of columns at a time. Untiled they run faster (at N=4096, D=64,
  V=151552, float32: 3.59 s a step against 4.69 s tiled, on 2 cores). Other
  platforms go untiled.
  """
  if platform != "cpu" or 2 * 4 * vocab * dim <= memory_budget // UNTILED_SHARE:
    return None
  return MATMUL_TILE


def dlogits_in_place(logits_dtype, dtype) -> bool:
  """Whether ``dlogits`` (in ``dtype``) can overwrite logits of ``logits_dtype``.

  The planner and the gradient sweep both decide by this: only then does a
  group hold one ``[rows, V]`` buffer.
  """
  return logits_dtype is not None and np.dtype(logits_dtype) == np.dtype(dtype)


def plan_chunks(
  n_rows: int,
  vocab_size: int,
  dtype: np.dtype,
  *,
  memory_budget: int = DEFAULT_MEMORY_BUDGET,
  logits_dtype: np.dtype | None = None,
  copy_bytes: int = 0,
) -> tuple[int, int]:
  """``(rows_per_chunk, rows_per_group)`` whose temporaries fit the budget.

  Logits in the compute dtype (``logits_dtype`` equal to ``dtype``: bfloat16
  logits of bfloat16 inputs, float32 of float32 ones): a group whose rows all
  count forms its logits in one matmul and its ``dlogits`` overwrite them
  (``itemsize V`` bytes a row); a group with excluded rows goes in
  ``CHUNKS_PER_GROUP`` chunks, skipping those without a valid row, whose
  logits take an eighth more. ``rows_in_budget`` splits ``n_rows`` into
  groups: 32768 rows at most 8372 a group make four of 8192, each in chunks
  of 1024.

  Other logits (``logits_dtype`` None, wider than ``dtype``, or another
  16-bit type; counted as float32): a chunk's
  float32 logits (``4 V`` bytes a row) take at most a quarter of the budget
  and a group's dlogits (``itemsize V`` bytes a row) the rest: big groups mean
  few read-modify-writes of ``dweight``, small chunks leave room for them. The
  group is a whole number of chunks (no chunk straddles two groups) and splits
  ``n_rows`` into as few groups as evenly as it can: 8192 rows at most 6300 a
  group make two groups of 4096, not 6144 and a clamped remainder.

  Chunks are multiples of 128 rows (tensor cores) when the budget allows it,
  else of 8.

  Args:
    n_rows: ``N``, the number of rows (tokens); neither size exceeds it.
    vocab_size: ``V``.
    dtype: the compute dtype of the matmuls (that of ``dlogits``).
    memory_budget: bytes for the chunk temporaries.
    logits_dtype: the dtype of a chunk's logits; None: float32.
    copy_bytes: bytes per logit that the backend holds beside the logits
      (``CPU_COPY_BYTES`` on XLA:CPU, which reduces them from a float32 copy).

  Returns:
    ``(rows_per_chunk, rows_per_group)``, ``1 <= chunk <= group <= n_rows``.
  """
  itemsize = np.dtype(dtype).itemsize
  # No more than the whole logits in the compute dtype (what a full-logits head
  # holds): at small N, chunking must not cost more memory than it saves.
  if dlogits_in_place(logits_dtype, dtype):
    per_row = (itemsize * (1 + 1 / CHUNKS_PER_GROUP) + copy_bytes) * vocab_size
    group = rows_in_budget(n_rows, per_row, memory_budget)
    chunk = -(-group // CHUNKS_PER_GROUP)
    return (_round_up(chunk, 8) if chunk >= 8 else group), group
  memory_budget = min(memory_budget, max(n_rows * vocab_size * itemsize, 1))
  chunk = _aligned_rows(memory_budget // 4 // ((4 + copy_bytes) * vocab_size))
  if chunk >= n_rows:
    return n_rows, n_rows
  chunk_bytes = chunk * (4 + copy_bytes) * vocab_size
  group_most = (memory_budget - chunk_bytes) // (itemsize * vocab_size)
  return chunk, _fewest_rewrites_group(n_rows, chunk, max(chunk, group_most))


def _aligned_rows(rows: int) -> int:
  """``rows`` rounded down to a multiple of 128 (of 8 below 128), at least 8."""
  align = _ROW_ALIGN if rows >= _ROW_ALIGN else 8
  return max(align, rows // align * align)


def _fewest_rewrites_group(n_rows: int, chunk: int, group_most: int) -> int:
  """The group size (whole chunks, or all rows) with the fewest dweight rewrites.

  A whole group rewrites ``dweight`` once; the clamped last group, which owns
  only the rows the others left, is counted once per chunk it owns (it runs
  chunk by chunk). Ties go to the larger group.
  """
  candidates = [
    k * chunk for k in range(1, group_most // chunk + 1) if k * chunk <= n_rows
  ]
  if n_rows <= group_most:
    candidates.append(n_rows)

  def rewrites(group):
    n_groups = -(-n_rows // group)
    last_owned = n_rows - (n_groups - 1) * group
    last = 1 if last_owned == group else -(-last_owned // chunk)
    return n_groups - 1 + last, -group

  return min(candidates, key=rewrites) if candidates else chunk


def plan_vocab_blocked_rows(
  n_rows: int,
  dim: int,
  vocab_block: int,
  dtype: np.dtype,
  *,
  memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> int:
  """Rows per chunk for the vocabulary-blocked loop order (``vocab_block_size``).

  A row costs a float32 ``dhidden`` accumulator row (``4 D`` bytes) and a row
  of the block's float32 logits and ``dlogits`` (``(4 + itemsize) B``). Fewer,
  bigger chunks mean fewer passes over ``dweight``; chunks are multiples of
  128 rows when the budget allows, else of 8.
  """
  per_row = 4 * dim + (4 + np.dtype(dtype).itemsize) * vocab_block
  return int(min(n_rows, _aligned_rows(memory_budget // per_row)))


# A plan may compute this fraction of rows twice (the last block ends at row
# N and overlaps the previous one) rather than add blocks.
_MAX_OVERLAP = 1 / 32


def rows_in_budget(n_rows: int, bytes_per_row: float, budget: int) -> int:
  """Rows per block when a block's temporaries take ``bytes_per_row`` a row
  and must fit ``budget``: the one rule for cross-entropy's groups (logits in
  the compute dtype) and distillation's chunks.

  Blocks are multiples of 128 rows (of 8, below 128), as few as fit, unless
  the last one (which ends at row ``N``) would overlap its predecessor by
  more than ``_MAX_OVERLAP`` of the rows: then the fewest blocks (up to
  twice as many) that overlap least. 8192 rows at most 1280 a block are 8
  blocks of 1024, not 7 of 1280.
  """
  most = int(budget // bytes_per_row)
  if most >= n_rows:
    return n_rows
  align = _ROW_ALIGN if most >= _ROW_ALIGN else 8
  most = max(most // align * align, min(8, n_rows))
  fewest = -(-n_rows // most)

  def rows(n_blocks):
    even = -(-n_rows // n_blocks)
    return min(most, _round_up(even, _ROW_ALIGN if even >= _ROW_ALIGN else 8), n_rows)

  counts = range(fewest, 2 * fewest + 1)
  good = [k for k in counts if k * rows(k) - n_rows <= n_rows * _MAX_OVERLAP]
  return rows(good[0] if good else min(counts, key=lambda k: k * rows(k)))


# Up to this many groups, dweight accumulates in the weight's dtype in place.
MAX_GROUPS_IN_PLACE = 2


# ---- float16 gradients: formed from unit row weights, scaled in float32. ----


def scales_gradients(dtype) -> bool:
  """Whether gradients in ``dtype`` are formed from unit row weights
  (``unit_weights``): float16, whose range ends at 6e-8, below the
  ``dlogits`` of a mean over many tokens (``p / N``). bfloat16 has
  float32's range: its programs are not scaled."""
  return np.dtype(dtype) == np.dtype(np.float16)


def unit_weights(weights: tuple, valid, dtype):
  """``(unit, scale)``: per-row weights of a gradient (cotangents, a mean's
  ``1 / n``; ``[N]`` or ``[N, K]``) over ``scale``, a float32 scalar on the
  device, their largest magnitude at a ``valid`` row, for gradients in a
  ``dtype`` that ``scales_gradients``; else ``(weights, None)``.

  ``dlogits`` of unit weights keep float16's precision; ``scale`` multiplies
  their products in float32 before each rounding to float16 (``rounded``,
  ``add_scaled``), or a float32 accumulator's sum at its last cast
  (``finished``).
  """
  if not scales_gradients(dtype):
    return weights, None
  rows = lambda w: valid.reshape(valid.shape + (1,) * (w.ndim - valid.ndim))
  largest = [jnp.max(jnp.where(rows(w), jnp.abs(w), 0)) for w in weights]
  largest = functools.reduce(jnp.maximum, largest).astype(jnp.float32)
  scale = jnp.where(largest > 0, largest, 1.0)  # a NaN stays in its rows
  return tuple(w / scale for w in weights), scale


def product_dtype(dtype, scale) -> np.dtype:
  """The dtype a product bound for ``dtype`` is formed in: float32 where it
  is scaled before its rounding to ``dtype`` (float16), else ``dtype``."""
  if scale is None or not scales_gradients(dtype):
    return np.dtype(dtype)
  return np.dtype(np.float32)


def rounded(x, dtype, scale):
  """``x`` (a ``product_dtype`` product of unit gradients) times ``scale``,
  rounded once to ``dtype``."""
  return (x if scale is None else x * scale).astype(dtype)


def add_scaled(total, part, scale):
  """``total + part``, ``part`` formed in ``product_dtype(total.dtype, scale)``.

  A float16 accumulator holds scaled gradients: ``part`` is scaled and the
  sum rounded once. Any other holds the unscaled sum (``finished``).
  """
  if product_dtype(total.dtype, scale) == total.dtype:
    return total + part
  return (total.astype(part.dtype) + part * scale).astype(total.dtype)


def finished(total, dtype, scale):
  """An accumulator of ``add_scaled`` in ``dtype``: scaled where it holds
  the unscaled sum."""
  if scale is not None and product_dtype(total.dtype, scale) == total.dtype:
    total = total * scale
  return total.astype(dtype)


def default_accum_dtype(
  n_rows: int, rows_per_group: int, weight_dtype: np.dtype
) -> np.dtype | None:
  """None (accumulate ``dweight`` in place) for few groups, else float32.

  Each group adds one rounding of the running ``dweight`` in the weight's
  dtype; their error grows about as the square root of the number of groups.
  With two groups (the Llama-3 head at 8192 tokens) the error is within 1.1x
  that of full-logits autodiff; with four (V=256000, 131072 tokens on the
  H200) it was 1.9x, against 1.0x with a float32 accumulator
  (docs/benchmarks.md). Past two, the accumulator is worth its memory.
  float16 weights always get one (``scales_gradients``): it holds the sum of
  unit gradients, which float16's 65504 could not, scaled at its last cast.
  """
  if scales_gradients(weight_dtype):
    return np.dtype(np.float32)
  n_groups = -(-n_rows // rows_per_group)
  if n_groups <= MAX_GROUPS_IN_PLACE:
    return None
  return np.promote_types(weight_dtype, np.float32)


def bias_bytes(logits_dtype) -> int:
  """Bytes a logit that a bias's float32 product takes beside logits of
  ``logits_dtype`` (None: float32, which are that product)."""
  if logits_dtype is None or np.dtype(logits_dtype).itemsize >= 4:
    return 0
  return BIAS_BYTES


def plan_with_accumulator(
  n_rows: int,
  vocab_size: int,
  dim: int,
  dtype: np.dtype,
  weight_dtype: np.dtype,
  *,
  memory_budget: int,
  logits_dtype: np.dtype | None,
  cpu: bool = False,
  biased: bool = False,
  dlogits_apart: bool = False,
  accum_dtype: np.dtype | None = None,
) -> tuple[int, int, np.dtype | None]:
  """``(rows_per_chunk, rows_per_group, accum_dtype)`` within the budget.

  ``plan_chunks``, then ``default_accum_dtype``. A float32 ``[V, D]``
  accumulator comes out of the budget, less the ``dweight`` output's own
  bytes off the CPU: until the sweep's last cast writes the output, XLA can
  place other temporaries (a group's logits) in that output's buffer, so
  the accumulator adds only its size beyond it to the step's peak (the
  Llama-3 head at 32768 tokens on the H200: 2110 MiB extra with a float32
  accumulator in 4096-row groups, docs/benchmarks.md). When that takes at
  most half the budget, the rows are planned again in the rest; otherwise
  ``dweight`` accumulates in place (a rounding per group): the budget is a
  cap, also where it costs accuracy.

  ``accum_dtype``: the caller's (None: choose). One wider than the weight's
  comes out of the budget too, as does float16 weights' default one
  (``default_accum_dtype``): the rows get what it leaves, at least a
  quarter of the budget.

  ``cpu``: plan for what XLA:CPU holds besides (``cpu_fixed_bytes``, and
  ``CPU_COPY_BYTES`` per logit), and count the whole accumulator.
  ``biased``: 16-bit logits hold a bias's float32 product beside them
  (``BIAS_BYTES`` per logit). ``dlogits_apart``: a group's ``dlogits`` are
  written beside its logits, not over them (XLA's cross-entropy on a GPU,
  where cuBLAS's logits leave no buffer to share).
  """
  copy_bytes = (CPU_COPY_BYTES if cpu else 0) + (
    bias_bytes(logits_dtype) if biased else 0
  )
  if dlogits_apart and dlogits_in_place(logits_dtype, dtype):
    copy_bytes += np.dtype(dtype).itemsize
  if cpu:
    tile = matmul_tile("cpu", vocab_size, dim, memory_budget) or vocab_size
    fixed = cpu_fixed_bytes(n_rows, dim, dtype, tile)
    memory_budget = max(memory_budget - fixed, memory_budget // 4)
  plan = functools.partial(
    plan_chunks,
    n_rows,
    vocab_size,
    dtype,
    logits_dtype=logits_dtype,
    copy_bytes=copy_bytes,
  )
  chunk, group = plan(memory_budget=memory_budget)
  accum = accum_dtype or default_accum_dtype(n_rows, group, weight_dtype)
  if accum is None:
    return chunk, group, None
  accumulator = vocab_size * dim * np.dtype(accum).itemsize
  output = 0 if cpu else vocab_size * dim * np.dtype(weight_dtype).itemsize
  if accum_dtype is not None or scales_gradients(weight_dtype):
    if np.dtype(accum).itemsize <= np.dtype(weight_dtype).itemsize:
      return chunk, group, accum  # in place
    rest = max(memory_budget - (accumulator - output), memory_budget // 4)
    return *plan(memory_budget=rest), accum
  if accumulator <= memory_budget and accumulator - output <= memory_budget // 2:
    return *plan(memory_budget=memory_budget - (accumulator - output)), accum
  return chunk, group, None


def cpu_fixed_bytes(n_rows: int, dim: int, dtype: np.dtype, columns: int) -> int:
  """Bytes XLA:CPU holds whatever the chunks: a tile's (``columns``) float32
  weight columns and ``dweight`` product, and, for 16-bit inputs, a copy of
  ``dhidden``'s bits (``_sweep.rows.Permuted``)."""
  tiles = 2 * 4 * columns * dim
  return tiles + (2 * n_rows * dim if np.dtype(dtype).itemsize < 4 else 0)


def tma_row_padding(n_rows: int, block_rows, gemm: str, dtype) -> int:
  """Rows to append so that the Mosaic GPU kernels take every block of rows
  of a plan (``block_rows``: its chunk and group sizes), or 0.

  The planner's chunks and groups are multiples of ``TMA_ROWS`` unless one
  holds all ``n_rows``, and then only ``n_rows`` may not be. A block the
  kernels do not take would run on XLA's GEMMs (autotuned on the first call:
  about twice a step's memory then) and the Triton kernels; the rows appended
  cost a copy of the hidden states instead, a few percent of such a block's
  logits (``D / V`` of them).
  """
  if (
    gemm != "mosaic"
    or np.dtype(dtype).itemsize != 2
    or n_rows % TMA_ROWS == 0
    or n_rows not in block_rows
  ):
    return 0
  return -n_rows % TMA_ROWS


def require_concrete(*arrays) -> None:
  """The plans need concrete sizes: symbolic dimensions
  (``jax.export``'s shape polymorphism) raise."""
  for x in arrays:
    if not all(isinstance(d, int) for d in x.shape):
      raise NotImplementedError(
        f"shape {x.shape} is symbolic: the chunked loss plans its chunks from"
        " concrete sizes. Export with concrete shapes, or pass"
        " impl='reference' (full logits)."
      )
