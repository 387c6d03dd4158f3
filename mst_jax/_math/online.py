"""The statistics pass's running sums, merged one vocabulary block at a time.

Both kernel backends (Pallas Triton and Mosaic GPU) walk a block of rows'
scores a block of columns at a time and keep, per row, an online max and the
sum of ``exp(s - max)`` (rescaled whenever the max grows), with label
smoothing the scores' sum, and with the entropy ``sum exp(s - max) s``.
``update`` merges one block; each kernel finds the target score and the
argmax its own way.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mst_jax._math import ce as ce_math


class Running(NamedTuple):
  """Per-row running sums, each ``[rows]``.

  Attributes:
    row_max: the max score so far (-inf before any).
    sum_exp: ``sum exp(s - max_shift(row_max))`` so far.
    total: the scores' sum, or their sum weighted by class weights (label
      smoothing; else stays 0).
    weighted: ``sum exp(s - max_shift(row_max)) s`` (the entropy; else 0).
  """

  row_max: jax.Array
  sum_exp: jax.Array
  total: jax.Array
  weighted: jax.Array


def start(n_rows: int, dtype=jnp.float32) -> Running:
  """The sums of no columns."""
  zeros = jnp.zeros((n_rows,), dtype)
  return Running(jnp.full((n_rows,), -jnp.inf, dtype), zeros, zeros, zeros)


def update(running: Running, capped, inside, options: ce_math.CEOptions, weights=None):
  """Merges a block of scores into ``running``.

  Args:
    running: the sums of the earlier blocks.
    capped: the block's scores ``[rows, block]`` (``ce_math.scores``).
    inside: bool, broadcastable to ``capped``: the columns inside the
      vocabulary (a ragged last block's others count for nothing).
    options: the loss options (which sums to keep).
    weights: float32 class weights, broadcast like ``capped``, or None:
      ``total`` sums the scores times them (a class of weight 0 adds 0, also
      where its score is -inf).

  Returns:
    ``(running, live, block_max)``: the new sums, the block's scores with
    -inf outside the vocabulary, and each row's max of them.
  """
  live = jnp.where(inside, capped, -jnp.inf)  # [rows, block]
  block_max = jnp.max(live, axis=1)
  new_max = jnp.maximum(running.row_max, block_max)
  # Rescaled to the new max, or to 0 while every score so far is -inf
  # (banned tokens): no mass, not exp(-inf - -inf) = NaN.
  shift = ce_math.max_shift(new_max)
  rescale = jnp.exp(running.row_max - shift)
  unnormalized = jnp.exp(live - ce_math.per_row(shift, live.shape))
  sum_exp = running.sum_exp * rescale + jnp.sum(unnormalized, axis=1)
  total, weighted = running.total, running.weighted
  if options.label_smoothing:
    if weights is not None:
      inside, capped = inside & (weights > 0), capped * weights
    total = total + jnp.sum(jnp.where(inside, capped, 0.0), axis=1)
  if options.entropy:  # a -inf score adds 0, not 0 * -inf
    spread = jnp.where(unnormalized > 0, unnormalized * live, 0.0)
    weighted = weighted * rescale + jnp.sum(spread, axis=1)
  return Running(new_max, sum_exp, total, weighted), live, block_max
