"""The row-chunked loop order: each chunk's logits over the whole vocabulary.

Rows are walked in chunks (``_sweep.rows.sweep_chunks``, valid rows compacted to
the front). Each chunk's ``[rows, V]`` logits are formed by the backend (in
``HeadSpec.logits_dtype``), reduced, and dropped:

* ``forward``: per-row ``(loss, lse, correct, entropy)``, and the logits at
  the rows' ids when there are ids; the recompute backward keeps only the
  lse and the entropy.
* ``backward``: recomputes each chunk's logits, forms ``dlogits`` from the
  saved lse, writes the chunk's ``dhidden`` rows and accumulates ``dweight``
  and ``dbias``: 8 N·D·V FLOPs with the forward.
* ``forward_keeping`` and ``backward_kept``: per-row outputs of one group of
  all rows whose logits fit the budget: the forward keeps the logits and the
  backward writes ``dlogits`` over them, 6 N·D·V FLOPs.
* ``fused``: for a scalar loss the cotangent of each row is known up to one
  scalar factor, so ``dlogits`` are formed in the same sweep as the loss, and
  the gradients with them: 6 N·D·V FLOPs, like full-logits autodiff.

How a sweep turns ``dlogits`` into gradients is one of three strategies
in ``_sweep.gradients``, chosen from the plan's chunk and group sizes and the
logits' dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mst_jax._kernels.base import write_into
from mst_jax._plan import unit_weights
from mst_jax._sweep.gradients import Sweep, accumulate, gradient_sweep
from mst_jax._sweep.rows import (
  chunk_of,
  gradient_finish,
  gradient_init,
  output_init,
  stat_dtype,
  sweep_chunks,
  with_bound,
)


@dataclasses.dataclass(frozen=True)
class RowChunks:
  """The row-chunked loop order (static, hashable; a ``driver.LoopOrder``).

  Attributes:
    rows_per_chunk: rows whose logits exist at once (outside whole groups),
      ``1 <= rows_per_chunk <= rows_per_group``.
    rows_per_group: rows whose ``dhidden`` and ``dweight`` matmuls run at once
      when all of them count (``_plan.plan_chunks``), ``<= N``.
    compact: move valid rows to the front before chunking.
    bounded: each block of rows runs its products and kernels to one past
      its last valid row, a bound known on the device
      (``_sweep.rows.with_bound``; the Mosaic GEMMs).
  """

  rows_per_chunk: int
  rows_per_group: int
  compact: bool = True
  bounded: bool = False

  def _all_rows(self, valid):
    """All rows as one chunk (bounded as the order says)."""
    chunk = chunk_of(valid.shape[0], valid, 0)
    return with_bound(chunk) if self.bounded else chunk

  def forward(self, config, x):
    """Per-row ``(loss, lse, correct, entropy)``, and the logits at
    ``x.ids`` when there are ids."""
    x, _, scatter = x.compacted(self.compact)

    def update(outputs, chunk):
      config.announce("forward", chunk.start)
      if x.ids is None:
        rows = x.chunk(chunk)
        new = config.row_outputs(
          config.whole_row_stats(rows), rows.labels, chunk.valid, rows.classes
        )
      else:
        new, _ = _outputs_and_logits(config, x, chunk)
      return tuple(map(chunk.put, outputs, new))

    init = output_init(x.hidden.shape[0], stat_dtype(x.hidden), x.ids)
    outputs = sweep_chunks(
      self.rows_per_chunk, x.valid, update, init, bounded=self.bounded
    )
    return tuple(map(scatter, outputs))

  def forward_keeping(self, config, x):
    """``(forward, logits)``: all rows as one chunk, and its logits, which
    ``backward_kept`` forms ``dlogits`` over instead of recomputing them."""
    chunk = self._all_rows(x.valid)
    config.announce("forward", chunk.start)
    return _outputs_and_logits(config, x, chunk)

  def backward_kept(self, config, x, cot, diff, logits):
    """``backward`` from ``forward_keeping``'s logits (in place where the
    backend can): the dlogits, dhidden and dweight of one chunk of all rows."""
    chunk = self._all_rows(x.valid)
    rows = x.chunk(chunk)
    cot, scale = cot.unit(x.valid, x.hidden.dtype)
    coefficients = config.backward_rows(cot, rows.labels, chunk.valid, rows.classes)
    dlogits = config.backend.chunk_backward(
      rows,
      coefficients,
      config.head,
      x.hidden.dtype,
      offset=config.columns.offset(),
      logits=logits,
    )
    dlogits = _with_ids(config, dlogits, x, cot, chunk)
    grads = gradient_init(config, x, diff)
    grads = accumulate(
      config, grads, chunk, rows.hidden, dlogits, x.weight, scale=scale
    )
    return gradient_finish(grads, x, scale)

  def backward(self, config, x, cot, diff):
    """``(dhidden, dweight, dbias)`` by recomputing each chunk's logits."""
    x, gather, _ = x.compacted(self.compact)  # recomputed: cheaper than saved
    cot, scale = cot.map(gather).unit(x.valid, x.hidden.dtype)
    offset = config.columns.offset()

    def chunk_dlogits(outputs, chunk, into):
      config.announce("backward", chunk.start)
      rows = x.chunk(chunk)
      coefficients = config.backward_rows(
        cot.take(chunk), rows.labels, chunk.valid, rows.classes
      )
      dlogits = config.backend.chunk_backward(
        rows, coefficients, config.head, x.hidden.dtype, offset=offset
      )
      dlogits = _with_ids(config, dlogits, x, cot, chunk)
      return outputs, write_into(into, dlogits)

    # grad-of-grad recomputes the chunk instead of saving its logits.
    sweep = Sweep(self, config, x, jax.checkpoint(chunk_dlogits), scale)
    _, grads = gradient_sweep(sweep, diff, ())
    return grads

  def fused(self, config, x, row_scale, diff):
    """``((sum(loss * row_scale), lse, correct, entropy), grads)`` in one sweep."""
    x, gather, scatter = x.compacted(self.compact)
    row_scale = gather(row_scale)
    (unit,), scale = unit_weights((row_scale,), x.valid, x.hidden.dtype)

    def chunk_dlogits(outputs, chunk, into):
      config.announce("fused", chunk.start)
      rows = x.chunk(chunk)
      g_loss = jnp.where(chunk.valid, chunk.take(unit), 0.0)
      stats, dlogits = config.backend.chunk_forward_backward(
        rows,
        g_loss,
        config.head,
        x.hidden.dtype,
        valid=chunk.valid,
        columns=config.columns,
        into=into,
      )
      outputs = map(
        chunk.put,
        outputs,
        config.row_outputs(stats, rows.labels, chunk.valid, rows.classes),
      )
      return tuple(outputs), dlogits

    sweep = Sweep(self, config, x, chunk_dlogits, scale)
    init = output_init(x.hidden.shape[0], stat_dtype(x.hidden))
    (loss, *per_row), grads = gradient_sweep(sweep, diff, init)
    return (jnp.sum(loss * row_scale), *map(scatter, per_row)), grads


def _outputs_and_logits(config, x, chunk):
  """``(outputs, logits)`` of a chunk: its per-row outputs, with the logits
  at ``x.ids`` when there are ids, and the logits they came from."""
  rows = x.chunk(chunk)
  logits, stats = config.logits_and_row_stats(rows)
  outputs = config.row_outputs(stats, rows.labels, chunk.valid, rows.classes)
  if x.ids is not None:
    outputs = (*outputs, config.row_logits_at(logits, chunk.take(x.ids), chunk.valid))
  return outputs, logits


def _with_ids(config, dlogits, x, cot, chunk):
  """A chunk's ``dlogits`` with the cotangents of its logits at ``x.ids``
  added (``SweepConfig.add_at``), where they are given."""
  g = cot.at_ids_of(chunk)
  return dlogits if g is None else config.add_at(dlogits, chunk.take(x.ids), g)
