"""How a row-chunked sweep turns each chunk's ``dlogits`` into gradients.

``gradient_sweep`` picks one of three strategies from the plan's chunk and
group sizes and the logits' dtype:

* ``_per_chunk``: a group is one chunk; every chunk does its own matmuls.
* ``_whole_groups_in_place``: logits in the compute dtype; a group's logits
  are formed in one matmul and its ``dlogits`` overwrite them.
* ``_group_buffer``: logits wider than the compute dtype; each chunk's
  ``dlogits`` are gathered into one group buffer.

``Sweep`` holds what they share: the loop order, the configuration, the
rows, how a chunk's ``dlogits`` are formed (``_sweep.row_chunks``' backward
recomputes them; its fused sweep forms them with the loss) and, for float16,
the scale of their unit row weights (``_plan.unit_weights``), applied
where each product is rounded (``row_products``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mst_jax._gemm import matmul
from mst_jax._plan import add_scaled, dlogits_in_place, product_dtype, rounded
from mst_jax._sweep.rows import (
  Chunk,
  Differentiated,
  Grads,
  RowInputs,
  SweepConfig,
  chunk_of,
  gradient_finish,
  gradient_init,
  sweep_chunks,
)


def row_products(
  grads: Grads,
  dlogits: jax.Array,
  h: jax.Array,
  weight: jax.Array,
  layout: str,
  scale: jax.Array | None,
  *,
  tile: int | None = None,
  gemm: str = "xla",
  bound: jax.Array | None = None,
):
  """A block of rows' ``dhidden`` rows (None without ``grads[0]``) and
  ``grads[1]`` (``dweight``) with its product added, by
  ``_gemm.matmul.row_gradients`` (to ``bound``).

  ``dlogits`` are of unit row weights; with a ``scale`` (float16) the rows
  are formed in float32 and scaled as they are rounded, and a float16
  ``dweight`` (asked for) gets a float32 product (``add_scaled``).
  """
  dhidden, dweight = grads[:2]
  into = dweight is None or product_dtype(dweight.dtype, scale) == dweight.dtype
  rows, summed = matmul.row_gradients(
    dlogits,
    h,
    weight,
    layout,
    dhidden_dtype=None if dhidden is None else product_dtype(dhidden.dtype, scale),
    dweight=dweight if into else None,
    tile=tile,
    gemm=gemm,
    bound=bound,
  )
  if not into:
    width = matmul.vocab_size(weight, layout)
    part = matmul.dweight_matmul(
      dlogits, h, layout, jnp.float32, gemm=gemm, width=width, bound=bound
    )
    summed = add_scaled(dweight, part, scale)
  if rows is not None and scale is not None:
    rows = rounded(rows, dhidden.dtype, scale)
  return rows, summed


def add_bias_gradient(dbias, dlogits, scale, bound=None):
  """``dbias`` with a block of rows' ``dlogits`` (those before ``bound``)
  summed in (``add_scaled``)."""
  part = matmul.bias_gradient(
    dlogits, dbias.shape[0], product_dtype(dbias.dtype, scale), bound
  )
  return add_scaled(dbias, part, scale)


def accumulate(
  config: SweepConfig,
  grads: Grads,
  group: Chunk,
  h: jax.Array,
  dlogits: jax.Array,
  weight: jax.Array,
  *,
  scale: jax.Array | None = None,
  local: bool = False,
) -> Grads:
  """Adds one group's ``dlogits`` (to its ``bound``) to ``(dhidden, dweight,
  dbias)``.

  ``local``: ``dhidden`` is the
  enclosing group's rows, not all rows. ``scale``: of the unit row weights
  of ``dlogits`` (``row_products``).
  """
  dhidden, dweight, dbias = grads
  tile, gemm, bound = config.matmul_tile, config.gemm, group.bound
  dh, dweight = row_products(
    grads, dlogits, h, weight, config.layout, scale, tile=tile, gemm=gemm, bound=bound
  )
  if dhidden is not None:
    dh = config.columns.sum_partial(dh)
    dhidden = group.put(dhidden, dh, local=local)
  if dbias is not None:
    dbias = add_bias_gradient(dbias, dlogits, scale, bound)
  return dhidden, dweight, dbias


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One gradient sweep's inputs, shared by the strategies.

  ``chunk_dlogits(outputs, chunk, into) -> (outputs, dlogits)`` gives each
  chunk's (or group's) ``dlogits`` (with ``into=(buffer, row)``, written into
  ``buffer`` from ``row`` on, and the buffer returned).
  """

  order: Any  # the RowChunks: rows_per_chunk, rows_per_group, bounded
  config: SweepConfig
  x: RowInputs
  chunk_dlogits: Callable
  scale: jax.Array | None = None  # of dlogits' unit row weights (float16)

  @property
  def hidden(self):
    return self.x.hidden

  @property
  def weight(self) -> jax.Array:
    return self.x.weight

  @property
  def valid(self) -> jax.Array:
    return self.x.valid

  def chunk_update(self, carry, chunk: Chunk, local: bool = False):
    outputs, grads = carry
    outputs, dlogits = self.chunk_dlogits(outputs, chunk, None)
    h = chunk.hidden(self.hidden)
    grads = accumulate(
      self.config,
      grads,
      chunk,
      h,
      dlogits,
      self.weight,
      scale=self.scale,
      local=local,
    )
    return outputs, grads

  def chunk_by_chunk(self, carry, group: Chunk):
    return sweep_chunks(
      self.order.rows_per_chunk, group.valid, self.chunk_update, carry, group=group
    )

  def each(self, size: int, update, carry, **kwargs):
    """``sweep_chunks`` over all rows in blocks of ``size``, bounded as the
    loop order says."""
    bounded = self.order.bounded
    return sweep_chunks(size, self.valid, update, carry, bounded=bounded, **kwargs)


def _held(group: Chunk, chunk_size: int) -> jax.Array:
  """bool ``[chunks]``: which of the group's chunks (as ``chunk_of`` tiles
  it) hold a valid row."""
  n_chunks = -(-group.size // chunk_size)
  ends = jnp.minimum((jnp.arange(n_chunks) + 1) * chunk_size, group.size)
  counts = jnp.cumsum(group.valid)[ends - 1]
  return jnp.diff(counts, prepend=0) > 0


def _every_chunk(chunk_size: int):
  """A predicate of a group: each of its chunks holds a valid row, so the
  group runs whole (one ``dweight`` rounding)."""
  return lambda group: jnp.all(_held(group, chunk_size))


def _some_chunk_empty(every_chunk):
  """A group with a valid row and a chunk without one."""
  return lambda group: jnp.any(group.valid) & ~every_chunk(group)


def _per_chunk(sweep: Sweep, outputs, grads):
  """Chosen when a group is one chunk: every chunk does its own matmuls."""
  return sweep.each(sweep.order.rows_per_chunk, sweep.chunk_update, (outputs, grads))


def _whole_groups_in_place(sweep: Sweep, outputs, grads):
  """Chosen for logits in the compute dtype, groups of several chunks.

  Every group with a valid row forms its logits in one matmul, its
  ``dlogits`` overwrite them (excluded rows' are zero), and the ``dhidden``
  and ``dweight`` matmuls run over the whole group: ``dweight`` is read and
  written once per group, and the program holds one copy of each matmul.
  With ``order.bounded`` (the Mosaic GEMMs) the products stop at the group's
  last valid row on the device (``_sweep.rows.with_bound``). Each group's
  ``dhidden`` rows come back as ``[group, D]`` and are written outside.
  """
  config, hidden, weight = sweep.config, sweep.hidden, sweep.weight
  layout, dh_dtype, scale = config.layout, hidden.dtype, sweep.scale
  want_rows = grads[0] is not None

  def whole(outputs, dweight, dbias, group):
    outputs, dlogits = sweep.chunk_dlogits(outputs, group, None)
    h = group.hidden(hidden)
    _, dweight, dbias = accumulate(
      config,
      (None, dweight, dbias),
      group,
      h,
      dlogits,
      weight,
      scale=scale,
    )
    rows = None
    if want_rows:
      tile, gemm = config.matmul_tile, config.gemm
      rows = matmul.dhidden_matmul(
        dlogits,
        weight,
        layout,
        product_dtype(dh_dtype, scale),
        tile=tile,
        gemm=gemm,
        bound=group.bound,
      )
      if scale is not None:
        rows = rounded(rows, dh_dtype, scale)
      rows = config.columns.sum_partial(rows)
    return outputs, rows, dweight, dbias

  def group_update(part):
    def run(carry, group):
      outputs, (dhidden, dweight, dbias) = carry
      outputs, rows, dweight, dbias = part(outputs, dweight, dbias, group)
      if want_rows:
        dhidden = group.put(dhidden, rows)
      return outputs, (dhidden, dweight, dbias)

    return run

  group_size = sweep.order.rows_per_group
  return sweep.each(group_size, group_update(whole), (outputs, grads))


def _group_buffer(sweep: Sweep, outputs, grads):
  """Chosen for logits wider than the compute dtype (float32 logits of bf16).

  Each chunk's float32 logits become ``dlogits`` in the compute dtype,
  gathered into one ``[group, V]`` buffer (in place, at rows that are
  multiples of the chunk size, when chunks tile the group exactly; V is the
  backend's ``dlogits_width``, which may pad the weight's columns); a group
  whose rows all count then does its ``dhidden`` and ``dweight`` matmuls
  once, as does one whose every chunk holds a valid row. Groups with a chunk
  of no valid row go chunk by chunk (a ``dweight`` rounding per chunk where
  ``dweight`` is in place): the buffer's rows of a skipped chunk would hold
  the previous group's. The two kinds run in two loops (a ``lax.cond``
  between them inside one loop made XLA copy the carried ``dweight``).
  """
  order, hidden, weight = sweep.order, sweep.hidden, sweep.weight
  group_size, chunk_size = order.rows_per_group, order.rows_per_chunk
  into_buffer = group_size % chunk_size == 0

  def whole_group(carry, group):
    outputs, grads, buffer = carry

    def fill(carry, chunk):
      outputs, buffer = carry
      if into_buffer:
        return sweep.chunk_dlogits(outputs, chunk, (buffer, chunk.offset))
      outputs, dlogits = sweep.chunk_dlogits(outputs, chunk, None)
      return outputs, chunk.put(buffer, dlogits, local=True)

    outputs, buffer = sweep_chunks(
      chunk_size, group.valid, fill, (outputs, buffer), group=group
    )
    h = group.hidden(hidden)
    grads = accumulate(sweep.config, grads, group, h, buffer, weight, scale=sweep.scale)
    return outputs, grads, buffer

  config = sweep.config
  chunk = jax.eval_shape(lambda x: x.chunk(chunk_of(chunk_size, x.valid, 0)), sweep.x)
  width = config.backend.dlogits_width(chunk, config.head)
  buffer = jnp.zeros((group_size, width), hidden.dtype)
  every_chunk = _every_chunk(chunk_size)
  carry = (outputs, grads, buffer)
  outputs, grads, _ = sweep_chunks(
    group_size, sweep.valid, whole_group, carry, visit=every_chunk
  )
  return sweep_chunks(
    group_size,
    sweep.valid,
    sweep.chunk_by_chunk,
    (outputs, grads),
    visit=_some_chunk_empty(every_chunk),
  )


def gradient_sweep(sweep: Sweep, diff: Differentiated, outputs):
  """Gradients from ``sweep.chunk_dlogits``, by the strategy that fits the plan.

  Returns:
    ``(outputs, (dhidden, dweight, dbias))``; a gradient is None where ``diff``
    says its input is not differentiated.
  """
  config, order = sweep.config, sweep.order
  grads = gradient_init(config, sweep.x, diff)
  if order.rows_per_chunk == order.rows_per_group:
    strategy = _per_chunk
  elif dlogits_in_place(config.head.logits_dtype, sweep.hidden.dtype):
    strategy = _whole_groups_in_place
  else:
    strategy = _group_buffer
  outputs, grads = strategy(sweep, outputs, grads)
  return outputs, gradient_finish(grads, sweep.x, sweep.scale)
