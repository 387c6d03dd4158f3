"""The low-memory loop order: vocabulary blocks inside row chunks.

``linear_cross_entropy(..., vocab_block_size=B)`` walks each chunk of rows
through the vocabulary in blocks of ``B`` columns, twice:

1. **Statistics.** Each block's ``[rows, B]`` float32 logits are reduced by
   the backend and merged into the running row statistics
   (``ce_math.combine_stats``: an online max / sum-exp, the target logit from
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
compacted (``DriverConfig.compact`` is ignored; the row-chunked path's
compaction gathers rows without copying ``hidden``, so this mode could adopt
it). ``dweight`` accumulates in the weight's
dtype by default, whatever the number of row chunks: a float32 ``[V, D]``
accumulator would be the largest buffer of a mode meant to be small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import ce_math, chunked, sharded


def _vocab_axis(config) -> int:
  return 0 if config.weight_layout == "vd" else 1


def _widths(config, weight) -> tuple[int, int]:
  """``(columns, block)``: this device's vocabulary and its block width."""
  vocab = weight.shape[_vocab_axis(config)]
  return vocab, min(config.vocab_block, vocab)


def _over_blocks(config, weight, step, carry, *, skip_first=False):
  """``carry = step(carry, start, size)`` for each vocabulary block in order.

  Full blocks run in a ``lax.scan``; a remainder of ``V mod B`` columns runs
  once more at its own (static) width. ``skip_first`` leaves out block 0.
  """
  vocab, block = _widths(config, weight)
  n_full, tail = divmod(vocab, block)
  starts = jnp.arange(int(skip_first), n_full, dtype=jnp.int32) * block
  carry, _ = lax.scan(lambda c, start: (step(c, start, block), None), carry, starts)
  if tail:
    carry = step(carry, jnp.int32(vocab - tail), tail)
  return carry


def _block(config, weight, bias, start, size):
  """The weight's (and bias's) columns ``[start, start + size)``."""
  w = lax.dynamic_slice_in_dim(weight, start, size, axis=_vocab_axis(config))
  b = None if bias is None else lax.dynamic_slice_in_dim(bias, start, size)
  return w, b


def row_stats(config, h, weight, bias, labels) -> ce_math.RowStats:
  """Whole-row statistics of ``h``'s logits, merged block by block.

  On a vocab-parallel shard (``VocabShardedCE``) the blocks of this shard are
  merged first and the shards combined once, so the collectives run once per
  row chunk, not once per block.
  """
  backend, local = config.backend, labels
  shards = isinstance(backend, sharded.VocabShardedCE)
  if shards:
    backend, local = backend.inner, backend.local_labels(labels)
  stacked = lambda reduce: functools.partial(reduce, axis=0)
  merge = functools.partial(
    ce_math.combine_stats,
    vocab_size=config.vocab_size(weight),
    reduce_max=stacked(jnp.max),
    reduce_sum=stacked(jnp.sum),
    reduce_min=stacked(jnp.min),
  )

  def block_stats(start, size):
    w, b = _block(config, weight, bias, start, size)
    logits = chunked.logits_matmul(h, w, b, config.weight_layout, config.logits_dtype)
    stats = backend.forward(logits, local - start, config.options)
    return stats, (local >= start) & (local < start + size)

  def step(carry, start, size):
    running, covered = carry
    stats, here = block_stats(start, size)
    parts = jax.tree.map(lambda a, b: jnp.stack([a, b]), running, stats)
    merged = merge(
      parts,
      jnp.stack([jnp.ones_like(here), here]),  # running: target already placed
      jnp.stack([jnp.int32(0), start])[:, None],  # running: argmax already global
      jnp.stack([covered, jnp.asarray(size, covered.dtype)])[:, None],
    )
    return merged, covered + size

  _, first_size = _widths(config, weight)
  first, here = block_stats(jnp.int32(0), first_size)
  one = lambda x: x[None]
  running = merge(
    jax.tree.map(one, first),
    one(here),
    jnp.zeros((1, 1), jnp.int32),
    jnp.ones((1, 1), first.mean_logit.dtype),
  )
  covered = jnp.asarray(first_size, first.mean_logit.dtype)
  running, _ = _over_blocks(config, weight, step, (running, covered), skip_first=True)
  return config.backend.combine(running, local) if shards else running


def _chunk_gradients(config, grads, chunk, hidden, weight, bias, labels, rows):
  """Adds one row chunk's contribution to ``(dhidden, dweight, dbias)``."""
  dhidden, dweight, dbias = grads
  h = chunk.hidden(hidden)
  layout, axis = config.weight_layout, _vocab_axis(config)
  vocab_size = config.vocab_size(weight)
  acc = jnp.promote_types(hidden.dtype, jnp.float32)

  def add_block(total, part, start, axis):
    old = lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis=axis)
    return lax.dynamic_update_slice_in_dim(total, old + part, start, axis)

  def step(carry, start, size):
    dh, dw, db = carry
    w, b = _block(config, weight, bias, start, size)
    logits = chunked.logits_matmul(h, w, b, layout, config.logits_dtype)
    dlogits = config.backend.backward(
      logits, labels - start, rows, config.options, hidden.dtype, vocab_size
    )
    if dh is not None:
      dh = dh + chunked.dhidden_matmul(dlogits, w, layout, acc)
    if dw is not None:
      dw = add_block(
        dw, chunked.dweight_matmul(dlogits, h, layout, dw.dtype), start, axis
      )
    if db is not None:
      db = add_block(db, jnp.sum(dlogits, axis=0, dtype=db.dtype), start, 0)
    return dh, dw, db

  dh = None if dhidden is None else jnp.zeros(h.shape, acc)
  dh, dweight, dbias = _over_blocks(config, weight, step, (dh, dweight, dbias))
  if dhidden is not None:
    dhidden = chunk.put(dhidden, dh.astype(dhidden.dtype))
  return dhidden, dweight, dbias


def forward(config, hidden, weight, bias, labels, valid):
  """Per-row ``(loss, lse, correct)`` (the plan's forward)."""
  return chunked.forward_rows(config, hidden, weight, bias, labels, valid, row_stats)


def backward(config, hidden, weight, bias, labels, valid, lse, g_loss, g_lse, diff):
  """``(dhidden, dweight, dbias)`` from saved lse and the row cotangents."""
  vocab_size = config.vocab_size(weight)

  def update(grads, chunk):
    config.announce("backward", chunk.start)
    y = chunk.take(labels)
    rows = ce_math.backward_rows(
      *map(chunk.take, (g_loss, g_lse, lse)), y, chunk.valid, config.options, vocab_size
    )
    return _chunk_gradients(config, grads, chunk, hidden, weight, bias, y, rows)

  grads = chunked.gradient_init(config, hidden, weight, bias, diff)
  grads = chunked.sweep_chunks(config.rows_per_chunk, valid, update, grads)
  return chunked.gradient_finish(grads, weight, bias)


def fused(config, hidden, weight, bias, labels, valid, row_scale, diff):
  """``((sum(loss * row_scale), lse, correct), grads)``, chunk by chunk."""
  vocab_size = config.vocab_size(weight)

  def update(carry, chunk):
    outputs, grads = carry
    config.announce("fused", chunk.start)
    y = chunk.take(labels)
    stats = row_stats(config, chunk.hidden(hidden), weight, bias, y)
    out = ce_math.row_outputs(stats, y, chunk.valid, config.options, vocab_size)
    g_loss = jnp.where(chunk.valid, chunk.take(row_scale), 0.0)
    rows = ce_math.backward_rows(
      g_loss,
      jnp.zeros_like(g_loss),
      stats.lse,
      y,
      chunk.valid,
      config.options,
      vocab_size,
    )
    grads = _chunk_gradients(config, grads, chunk, hidden, weight, bias, y, rows)
    return tuple(map(chunk.put, outputs, out)), grads

  stat_dtype = jnp.promote_types(hidden.dtype, jnp.float32)
  init = (
    chunked.output_init(hidden.shape[0], stat_dtype),
    chunked.gradient_init(config, hidden, weight, bias, diff),
  )
  (loss, lse, correct), grads = chunked.sweep_chunks(
    config.rows_per_chunk, valid, update, init
  )
  outputs = (jnp.sum(loss * row_scale), lse, correct)
  return outputs, chunked.gradient_finish(grads, weight, bias)
