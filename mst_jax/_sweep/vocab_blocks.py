"""The low-memory loop order: vocabulary blocks inside row chunks.

``linear_cross_entropy(..., vocab_block_size=B)`` walks each chunk of rows
through the vocabulary in blocks of ``B`` columns, twice:

1. **Statistics.** Each block's ``[rows, B]`` float32 logits are reduced by
   the backend and merged into the running row statistics
   (``_math.ce.combine_stats``: an online max / sum-exp, the target logit from
   the block that holds the label, the mean, the first argmax).
2. **Gradients.** Each block's logits are formed again; the backend turns
   them into ``dlogits`` (the lse is known now); the block's rows of
   ``dweight`` get ``dlogits^T @ hidden`` and the chunk's ``dhidden``
   accumulates ``dlogits @ weight_block`` in float32.

Nothing of size ``[rows, V]`` exists: the temporaries are one block's logits
and ``dlogits`` and a ``[rows, D]`` float32 ``dhidden`` accumulator, so memory
does not grow with ``V``. The price: the logits are formed twice (8 N·D·V
FLOPs against the fused row-chunked path's 6), and ``dweight`` is read and
written once per row chunk (in place, block by block). The forward runs pass
1; the backward (or, for a scalar loss, the forward itself) runs both.

Row chunks without a valid row are skipped (``lax.cond``). Rows are not
compacted (the row-chunked order's compaction gathers rows without copying
``hidden``, so this order could adopt it). ``dweight`` accumulates in the
weight's dtype by default, whatever the number of row chunks: a float32
``[V, D]`` accumulator would be the largest buffer of a mode meant to be
small. float16 ``dweight`` blocks are added as float32 products of unit row
weights, scaled as each sum is rounded (``_plan.add_scaled``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._gemm import matmul
from mst_jax._kernels.base import ChunkInputs, relative_labels
from mst_jax._math import ce as ce_math
from mst_jax._plan import add_scaled, product_dtype, rounded, unit_weights
from mst_jax._sweep.rows import (
  Chunk,
  Grads,
  RowCotangents,
  SweepConfig,
  gradient_finish,
  gradient_init,
  output_init,
  stat_dtype,
  sweep_chunks,
)


@dataclasses.dataclass(frozen=True)
class VocabBlocks:
  """The vocabulary-blocked loop order (static, hashable; a ``driver.LoopOrder``).

  Attributes:
    rows_per_chunk: rows per chunk (``_plan.plan_vocab_blocked_rows``).
    block: vocabulary columns per block; the last block of a weight whose
      width is not a multiple is narrower.
  """

  rows_per_chunk: int
  block: int

  def _widths(self, config: SweepConfig, weight) -> tuple[int, int]:
    """``(columns, block)``: this device's vocabulary and its block width."""
    vocab = matmul.vocab_size(weight, config.layout)
    return vocab, min(self.block, vocab)

  def _over_blocks(
    self,
    config: SweepConfig,
    x: ChunkInputs,
    step: Callable,
    carry,
    *,
    skip_first: bool = False,
  ):
    """``carry = step(carry, block, start, size)`` for each vocabulary block.

    ``block`` is the chunk against the block's columns (``_block``). Full
    blocks run in a ``lax.scan``, a remainder of ``V mod B`` columns once
    more at its own width (``_gemm.matmul.over_columns``); ``skip_first`` leaves
    out block 0.
    """
    vocab, block = self._widths(config, x.weight)

    def each(carry, start, size, weight, bias):
      columns = _block(config, x._replace(weight=weight, bias=bias), start, size)
      return step(carry, columns, start, size)

    return matmul.over_columns(
      each,
      carry,
      (x.weight, x.bias),
      vocab,
      block,
      skip_first=skip_first,
      # Where the matmuls convert their operands (XLA:CPU), else XLA hoists
      # a float32 copy of the whole weight out of the loop.
      tie=config.head.matmul_tile is not None,
    )

  def _row_stats(self, config: SweepConfig, x: ChunkInputs, ids=None):
    """``(stats, at_ids)``: whole-row statistics of a chunk's logits, merged
    block by block, and its logits at ``ids [rows, K]`` (None without ids).

    On a vocab-parallel shard the blocks of this shard are merged first and
    the shards combined once, so the collectives run once per row chunk, not
    once per block.
    """
    labels = x.labels
    local = relative_labels(labels, config.columns.offset())
    # Over the stacked parts, keeping the axis (no implicit rank broadcasting).
    stacked = lambda reduce: functools.partial(reduce, axis=0, keepdims=True)
    combine = functools.partial(
      ce_math.combine_stats,
      vocab_size=config.head.vocab_size,
      reduce_max=stacked(jnp.max),
      reduce_sum=stacked(jnp.sum),
      reduce_min=stacked(jnp.min),
    )

    def merge(*args):
      return jax.tree.map(lambda x: x[0], combine(*args))

    x = x._replace(labels=local)

    def block_stats(block, start, size):
      here = (local >= start) & (local < start + size)
      if ids is None:
        return config.backend.chunk_forward(block, config.head, offset=start), here, 0
      logits, stats = config.logits_and_stats(block, start)
      return stats, here, config.logits_at(logits, ids, start)

    def step(carry, block, start, size):
      running, covered, at_ids = carry
      stats, here, at = block_stats(block, start, size)
      parts = jax.tree.map(lambda a, b: jnp.stack([a, b]), running, stats)
      merged = merge(
        parts,
        jnp.stack([jnp.ones_like(here), here]),  # running: target already placed
        jnp.stack([jnp.int32(0), start])[:, None],  # running: argmax already global
        jnp.stack([covered, jnp.asarray(size, covered.dtype)])[:, None],
      )
      return merged, covered + size, at_ids + at

    _, first_size = self._widths(config, x.weight)
    zero = jnp.int32(0)
    first, here, at_ids = block_stats(
      _block(config, x, zero, first_size), zero, first_size
    )
    one = lambda x: x[None]
    running = merge(
      jax.tree.map(one, first),
      one(here),
      jnp.zeros((1, 1), jnp.int32),
      jnp.ones((1, 1), first.mean_logit.dtype),
    )
    covered = jnp.asarray(first_size, first.mean_logit.dtype)
    carry = (running, covered, at_ids)
    running, _, at_ids = self._over_blocks(config, x, step, carry, skip_first=True)
    at_ids = None if ids is None else config.columns.sum_partial(at_ids)
    return config.columns.combine(running, labels), at_ids

  def _chunk_gradients(
    self,
    config: SweepConfig,
    grads: Grads,
    chunk: Chunk,
    x: ChunkInputs,
    rows,
    scale,
    at_ids=None,
  ) -> Grads:
    """Adds one row chunk's contribution to ``(dhidden, dweight, dbias)``
    (``rows`` of unit row weights: ``scale`` applied as each is rounded;
    ``at_ids``: ``(ids, g)``, cotangents of its logits at ids, or None)."""
    dhidden, dweight, dbias = grads
    layout, axis = config.layout, matmul.vocab_axis(config.layout)
    acc, gemm = stat_dtype(x.hidden), config.head.gemm
    x = x._replace(labels=relative_labels(x.labels, config.columns.offset()))

    def add_block(total, part, start, axis):
      old = lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis=axis)
      return lax.dynamic_update_slice_in_dim(
        total, add_scaled(old, part, scale), start, axis
      )

    def step(carry, block, start, size):
      dh, dw, db = carry
      dlogits = config.backend.chunk_backward(
        block, rows, config.head, x.hidden.dtype, offset=start
      )
      if at_ids is not None:
        dlogits = config.add_at(dlogits, *at_ids, start)
      if dh is not None:
        dh = dh + matmul.dhidden_matmul(dlogits, block.weight, layout, acc, gemm=gemm)
      if dw is not None:
        dweight_block = matmul.dweight_matmul(
          dlogits,
          x.hidden,
          layout,
          product_dtype(dw.dtype, scale),
          gemm=gemm,
          width=size,
        )
        dw = add_block(dw, dweight_block, start, axis)
      if db is not None:
        db_dtype = product_dtype(db.dtype, scale)
        db = add_block(db, matmul.bias_gradient(dlogits, size, db_dtype), start, 0)
      return dh, dw, db

    dh = None if dhidden is None else jnp.zeros(x.hidden.shape, acc)
    dh, dweight, dbias = self._over_blocks(config, x, step, (dh, dweight, dbias))
    if dhidden is not None:
      dh = config.columns.sum_partial(dh)
      dhidden = chunk.put(dhidden, rounded(dh, dhidden.dtype, scale))
    return dhidden, dweight, dbias

  def forward(self, config, x):
    """Per-row ``(loss, lse, correct, entropy)``, and the logits at
    ``x.ids`` when there are ids."""

    def update(outputs, chunk):
      config.announce("forward", chunk.start)
      rows = x.chunk(chunk)
      ids = None if x.ids is None else chunk.take(x.ids)
      stats, at_ids = self._row_stats(config, rows, ids)
      new = config.row_outputs(stats, rows.labels, chunk.valid, rows.classes)
      if ids is not None:
        new = (*new, jnp.where(chunk.valid[:, None], at_ids, 0))
      return tuple(map(chunk.put, outputs, new))

    init = output_init(x.hidden.shape[0], stat_dtype(x.hidden), x.ids)
    return sweep_chunks(self.rows_per_chunk, x.valid, update, init)

  def backward(self, config, x, cot, diff):
    """``(dhidden, dweight, dbias)`` from saved lse and the row cotangents."""
    cot, scale = cot.unit(x.valid, x.hidden.dtype)

    def update(grads, chunk):
      config.announce("backward", chunk.start)
      rows = x.chunk(chunk)
      coefficients = config.backward_rows(
        cot.take(chunk), rows.labels, chunk.valid, rows.classes
      )
      g = cot.at_ids_of(chunk)
      at_ids = None if g is None else (chunk.take(x.ids), g)
      return self._chunk_gradients(
        config, grads, chunk, rows, coefficients, scale, at_ids
      )

    grads = gradient_init(config, x, diff)
    grads = sweep_chunks(self.rows_per_chunk, x.valid, update, grads)
    return gradient_finish(grads, x, scale)

  def fused(self, config, x, row_scale, diff):
    """``((sum(loss * row_scale), lse, correct, entropy), grads)``, chunk by chunk."""
    (unit,), scale = unit_weights((row_scale,), x.valid, x.hidden.dtype)

    def update(carry, chunk):
      outputs, grads = carry
      config.announce("fused", chunk.start)
      rows = x.chunk(chunk)
      stats, _ = self._row_stats(config, rows)
      out = config.row_outputs(stats, rows.labels, chunk.valid, rows.classes)
      g_loss = jnp.where(chunk.valid, chunk.take(unit), 0.0)
      cot = RowCotangents.of_loss(stats.lse, g_loss)
      coefficients = config.backward_rows(cot, rows.labels, chunk.valid, rows.classes)
      grads = self._chunk_gradients(config, grads, chunk, rows, coefficients, scale)
      return tuple(map(chunk.put, outputs, out)), grads

    init = (
      output_init(x.hidden.shape[0], stat_dtype(x.hidden)),
      gradient_init(config, x, diff),
    )
    (loss, *per_row), grads = sweep_chunks(self.rows_per_chunk, x.valid, update, init)
    return (jnp.sum(loss * row_scale), *per_row), gradient_finish(grads, x, scale)


def _block(config: SweepConfig, x: ChunkInputs, start, size: int) -> ChunkInputs:
  """The chunk against the weight's (bias's, class weights') columns
  ``[start, start + size)``."""
  w = matmul.weight_columns(x.weight, start, size, config.layout)
  columns = lambda v: None if v is None else lax.dynamic_slice_in_dim(v, start, size)
  return x._replace(
    weight=w, bias=columns(x.bias), class_weights=columns(x.class_weights)
  )
