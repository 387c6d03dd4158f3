"""The cross-entropy's statistics of tiles of 16-bit logits, on Mosaic GPU.

One definition, run in two places: ``mosaic.ce``'s statistics kernel merges
the ``[rows, block_v]`` tiles of each vocabulary part it reads back, and
``TileStats`` (a ``RowEpilogue`` of the Mosaic GEMM) merges those of each
output tile of the logits GEMM in its epilogue, so the logits are not read
again for them. Either gives per-part ``RowStats`` that ``combine`` merges
with ``ce_math.combine_stats``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._math import ce as ce_math
from mst_jax._math import online


def start(n_rows: int):
  """The statistics of no columns: running sums, target score, argmax."""
  zeros = jnp.zeros((n_rows,), jnp.float32)
  return online.start(n_rows), zeros, jnp.zeros((n_rows,), jnp.int32)


def merge(
  carry, tile, first_col, labels, options: ce_math.CEOptions, n_cols: int, weights=None
):
  """Merges a ``[rows, columns]`` tile of logits (float32), whose first column
  is ``first_col``, into ``carry`` (``start``'s); ``labels`` relative to the
  logits' first column; columns from ``n_cols`` on count for nothing.
  ``weights``: the columns' class weights, float32 ``[columns]``, which
  weigh the scores' sum; or None."""
  running, target, argmax = carry
  shape = tile.shape
  cols = first_col + lax.broadcasted_iota(jnp.int32, shape, 1)
  capped = ce_math.scores(tile, options)
  if weights is not None:
    weights = lax.broadcast_in_dim(weights, shape, (1,))
  inside = cols < n_cols
  new, live, block_max = online.update(running, capped, inside, options, weights)
  at_label = cols == ce_math.per_row(labels, shape)
  target = target + jnp.where(at_label, live, 0.0).sum(axis=1)
  # The first column of the tile's max, kept if it beats the earlier tiles.
  at_max = live == ce_math.per_row(block_max, shape)
  first = jnp.where(at_max, cols, n_cols).min(axis=1)
  argmax = jnp.where(block_max > running.row_max, first, argmax)
  return new, target, argmax


def out_dtypes(options: ce_math.CEOptions) -> tuple:
  """Dtypes of ``finish``'s values."""
  extra = bool(options.label_smoothing) + options.entropy
  return (jnp.float32,) * 3 + (jnp.int32,) + (jnp.float32,) * extra


def finish(carry, options: ce_math.CEOptions) -> list:
  """A part's row max, log-sum-exp, target, argmax, and with label smoothing
  its scores' sum, with the entropy its expected score."""
  (row_max, sum_exp, total, weighted), target, argmax = carry
  values = [row_max, jnp.log(sum_exp), target, argmax]
  if options.label_smoothing:
    values.append(total)
  if options.entropy:
    values.append(weighted / sum_exp)
  return values


def combine(
  outputs: list, widths: jax.Array, n_cols: int, options, weight_sums=None
) -> ce_math.RowStats:
  """Whole-row ``RowStats`` from ``finish``'s values of each part (stacked,
  ``[parts, rows]``); ``widths``: each part's columns, float32 ``[parts, 1]``;
  ``weight_sums``: with class weights, each part's sum of them, likewise
  (the parts' sums of scores are then sums weighted by the class weights)."""
  row_max, log_sum_exp, target, argmax, *rest = outputs
  total = rest.pop(0) if options.label_smoothing else jnp.zeros_like(target)
  mean_weight = None
  if weight_sums is not None:  # a part of weight 0 adds nothing
    mean_weight = jnp.broadcast_to(weight_sums, target.shape)
    widths = jnp.where(weight_sums > 0, weight_sums, 1.0)
  parts = ce_math.RowStats(
    row_max,
    log_sum_exp,
    target,
    total / widths,
    argmax,
    expected_score=rest.pop(0) if options.entropy else None,
    mean_weight=mean_weight,
  )
  # Each part's target is 0 unless it holds the label; argmax is global.
  return ce_math.combine_stats(
    parts,
    jnp.ones(target.shape, bool),
    0,
    widths,
    n_cols,
    reduce_max=functools.partial(jnp.max, axis=0),
    reduce_sum=functools.partial(jnp.sum, axis=0),
    reduce_min=functools.partial(jnp.min, axis=0),
  )


def part_widths(n_cols: int, part_cols: int) -> jax.Array:
  """Each part's number of columns, float32 ``[parts, 1]``, for parts of
  ``part_cols`` columns (the last one ragged)."""
  starts = jnp.arange(-(-n_cols // part_cols)) * part_cols
  return jnp.minimum(n_cols - starts, part_cols)[:, None].astype(jnp.float32)


def approx_math(options: ce_math.CEOptions) -> bool:
  """Whether the kernels take Mosaic GPU's approximate math: ``exp`` as
  ``ex2.approx``, as Triton's ``exp`` (the statistics are arithmetic bound).
  Not with a softcap: its ``tanh`` would be approximate too, and the target
  score, which no sum averages, tens of float32 ulps off
  (docs/benchmarks.md)."""
  return options.logit_softcap is None


@dataclasses.dataclass(frozen=True)
class TileStats:
  """The statistics of each output tile of the logits GEMM, in its epilogue
  (a ``RowEpilogue``: the row input is the labels, relative to the logits'
  first column).

  Attributes:
    options: the loss options.
    n_cols: the logits' columns (the last tile's others count for nothing).
    piece: columns merged at a time (the tile's float32 temporaries are this
      wide, beside the accumulator's registers).
  """

  options: ce_math.CEOptions
  n_cols: int
  piece: int = 32

  input_dtypes = (jnp.int32,)

  @property
  def out_dtypes(self) -> tuple:
    return out_dtypes(self.options)

  @property
  def approx_math(self) -> bool:
    return approx_math(self.options)

  def __call__(self, tile, first_col, inputs):
    (labels,) = inputs
    carry = start(tile.shape[0])
    for j in range(0, tile.shape[1], self.piece):
      values = tile[:, j : j + self.piece].astype(jnp.float32)
      carry = merge(carry, values, first_col + j, labels, self.options, self.n_cols)
    return finish(carry, self.options)
