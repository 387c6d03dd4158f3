"""What both loop orders share: their configuration, chunks of rows, compaction.

* ``SweepConfig``: the static configuration every loop order reads.
* ``Chunk`` / ``chunk_of`` / ``sweep_chunks``: walking the rows in chunks
  with ``lax.scan``, skipping chunks without a valid row by ``lax.cond`` on a
  device-side predicate (nothing like ``.item()``; XLA:GPU copies each
  conditional's predicate to the host to launch its branch, a short wait per
  chunk that could be skipped). ``N`` need not be a multiple of the
  chunk: the last chunk is clamped to end at row ``N`` (it overlaps the
  previous one) and rows it does not own are excluded and never written.
* ``compaction``: valid rows stably moved to the front (a device-side
  ``argsort``), so every chunk past the number of valid rows is entirely
  excluded and skipped; scattered masks then save as much as prefix masks.
  ``[N, D]`` arrays are seen through the permutation (``Permuted``), never
  copied into compacted order.
* The gradient accumulators: started, and finished in their inputs' dtypes
  (float16's scaled there where they hold unscaled sums:
  ``_plan.unit_weights``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mst_jax import _manual_axes, _plan
from mst_jax._kernels import AllColumns, ChunkBackend, ChunkInputs, Columns, HeadSpec
from mst_jax._math import ce as ce_math


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """Static configuration shared by the loop orders (hashable).

  Attributes:
    backend: forms a chunk's logits and their cross-entropy.
    head: the layout, logits dtype, loss options and whole vocabulary size.
    dweight_dtype: dtype of the ``dweight`` accumulator (the weight's dtype:
      accumulated in place in the output, one rounding per group).
    dbias_dtype: dtype of the ``dbias`` accumulator.
    columns: the vocabulary columns this device's weight holds
      (``AllColumns``, or a vocab-parallel shard from the mesh layer).
    chunk_callback: if set, ``chunk_callback(pass_name, first_row)`` runs on
      the host (``jax.debug.callback``) for every block of rows whose logits
      are formed (a chunk, or a whole group when all its rows count) rather
      than skipped, with ``pass_name`` "forward", "backward" or "fused" and
      the block's first row (in compacted order). For tests and debugging; it
      costs a host round trip per block.
  """

  backend: ChunkBackend
  head: HeadSpec
  dweight_dtype: jnp.dtype
  dbias_dtype: jnp.dtype
  columns: Columns = AllColumns()
  chunk_callback: Callable[[str, jax.Array], None] | None = None

  @property
  def layout(self) -> str:
    return self.head.weight_layout

  @property
  def matmul_tile(self) -> int | None:
    return self.head.matmul_tile

  @property
  def gemm(self) -> str:
    return self.head.gemm

  def announce(self, pass_name: str, first_row: jax.Array) -> None:
    if self.chunk_callback is not None:
      jax.debug.callback(self.chunk_callback, pass_name, first_row)

  def row_outputs(
    self,
    stats: ce_math.RowStats,
    labels: jax.Array,
    valid: jax.Array,
    classes: ce_math.ClassRows | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-row ``(loss, lse, correct, entropy)`` of a chunk's whole-row
    statistics."""
    head = self.head
    return ce_math.row_outputs(
      stats, labels, valid, head.options, head.vocab_size, classes
    )

  def backward_rows(
    self,
    cot: RowCotangents,
    labels: jax.Array,
    valid: jax.Array,
    classes: ce_math.ClassRows | None = None,
  ) -> ce_math.BackwardRows:
    """Per-row ``dlogits`` coefficients from a chunk's cotangents."""
    head = self.head
    return ce_math.backward_rows(
      cot.g_loss,
      cot.g_lse,
      cot.lse,
      labels,
      valid,
      head.options,
      head.vocab_size,
      g_entropy=cot.g_entropy,
      entropy=cot.entropy,
      classes=classes,
    )

  def row_logits_at(self, logits: jax.Array, ids: jax.Array, valid: jax.Array):
    """A chunk's ``[rows, K]`` logits at ``ids`` (``logits_at`` over all of
    this device's columns, summed over the shards), 0 in excluded rows."""
    at = self.columns.sum_partial(self.logits_at(logits, ids))
    return jnp.where(valid[:, None], at, 0)

  def logits_at(self, logits: jax.Array, ids: jax.Array, start=0) -> jax.Array:
    """float32 (or wider) ``[rows, K]``: ``logits`` at ``ids [rows, K]``
    (vocabulary ids), 0 at ids outside them. ``logits``' first column is
    column ``start`` of this device's (a vocabulary block's); the parts of
    several blocks or shards add up (``Columns.sum_partial``)."""
    local, here = self._local_ids(ids, logits.shape[1], start)
    at = jnp.take_along_axis(logits, local, axis=1)
    return jnp.where(here, ce_math.upcast(at), 0)

  def add_at(self, dlogits: jax.Array, ids: jax.Array, g: jax.Array, start=0):
    """``dlogits`` with ``g [rows, K]`` added at ``ids``: the transpose of
    ``logits_at``."""
    local, here = self._local_ids(ids, dlogits.shape[1], start)
    rows = jnp.arange(ids.shape[0])[:, None]
    g = jnp.where(here, g, 0).astype(dlogits.dtype)
    return dlogits.at[rows, local].add(g, mode="promise_in_bounds")

  def _local_ids(self, ids: jax.Array, width: int, start):
    """``(columns, here)``: ``ids`` as columns (clipped) of logits ``width``
    wide from column ``start`` of this device's, and where they are one of
    those columns (not padding, not another device's)."""
    held = self.columns.shard_size if self.columns.split else self.head.vocab_size
    local = ids - (self.columns.offset() + start)
    here = (local >= 0) & (local < jnp.minimum(width, held - start))
    return jnp.clip(local, 0, width - 1), here

  def whole_row_stats(self, x: ChunkInputs) -> ce_math.RowStats:
    """A chunk's statistics over the whole vocabulary, combined across shards."""
    stats = self.backend.chunk_forward(x, self.head, offset=self.columns.offset())
    return self.columns.combine(stats, x.labels)

  def logits_and_row_stats(self, x: ChunkInputs) -> tuple[jax.Array, ce_math.RowStats]:
    """A chunk's logits and their ``whole_row_stats``."""
    logits, stats = self.logits_and_stats(x, self.columns.offset())
    return logits, self.columns.combine(stats, x.labels)

  def logits_and_stats(self, x: ChunkInputs, offset):
    """Logits (whose first column is ``offset``) and their statistics: from
    the logits GEMM's epilogue where the backend computes them there, else
    read back from the logits."""
    logits, stats = self.backend.logits_and_stats(x, self.head, offset)
    if stats is None:
      stats = self.backend.chunk_forward(x, self.head, offset=offset, logits=logits)
    return logits, stats


class RowInputs(NamedTuple):
  """The driver's arrays (hidden may be ``Permuted``, in compacted order).

  Attributes:
    hidden: ``[N, D]`` float.
    weight: ``[V, D]`` or ``[D, V]`` (``SweepConfig.layout``), hidden's dtype.
    bias: ``[V]`` float or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``; False rows give 0 loss, 0 lse and zero gradients.
    class_weights: float ``[V]`` class weights with label smoothing, or None
      (``Rows.for_chunks``).
    target_weight: float32 ``[N]``, the weight of each row's label; or None
      without class weights (then ``mean_weight`` is None too).
    mean_weight: float32 ``[N]``, the mean class weight (in every row).
    ids: int32 ``[N, K]`` vocabulary ids whose logits the forward also
      gives (``SweepConfig.logits_at``), or None.
  """

  hidden: Any
  weight: jax.Array
  bias: jax.Array | None
  labels: jax.Array
  valid: jax.Array
  class_weights: jax.Array | None = None
  target_weight: jax.Array | None = None
  mean_weight: jax.Array | None = None
  ids: jax.Array | None = None

  @property
  def classes(self) -> ce_math.ClassRows | None:
    if self.target_weight is None:
      return None
    return ce_math.ClassRows(self.target_weight, self.mean_weight)

  def _per_row(self, take) -> dict:
    """The per-row fields other than ``hidden``, through ``take``."""
    names = ("labels", "valid", "target_weight", "mean_weight", "ids")
    return {
      n: None if getattr(self, n) is None else take(getattr(self, n)) for n in names
    }

  def compacted(self, compact: bool):
    """``(rows, gather, scatter)``: these rows with valid ones first
    (``compaction``), and the maps of ``[N]`` arrays into that order and back."""
    gather, scatter, view = compaction(compact, self.valid)
    rows = self._replace(hidden=view(self.hidden), **self._per_row(gather))
    return rows, gather, scatter

  def chunk(self, chunk: Chunk) -> ChunkInputs:
    """A chunk's rows (excluded ones zeroed) with the whole weight."""
    classes = self.classes
    if classes is not None:
      classes = ce_math.ClassRows(*map(chunk.take, classes))
    return ChunkInputs(
      chunk.hidden(self.hidden),
      self.weight,
      self.bias,
      chunk.take(self.labels),
      class_weights=self.class_weights,
      classes=classes,
      bound=chunk.bound,
    )


class RowCotangents(NamedTuple):
  """What the recompute backward gets per row, each ``[N]`` float32.

  Attributes:
    lse: the forward's saved lse.
    g_loss: the cotangent of each row's loss.
    g_lse: the cotangent of each row's lse.
    entropy: the forward's saved entropy (zeros without
      ``CEOptions.entropy``).
    g_entropy: the cotangent of each row's entropy.
    g_at_ids: ``[N, K]``, the cotangent of the logits at ``RowInputs.ids``,
      or None.
  """

  lse: jax.Array
  g_loss: jax.Array
  g_lse: jax.Array
  entropy: jax.Array
  g_entropy: jax.Array
  g_at_ids: jax.Array | None = None

  @classmethod
  def of_loss(cls, lse: jax.Array, g_loss: jax.Array) -> RowCotangents:
    """Those of a loss alone (no cotangent on the lse or the entropy)."""
    zero = jnp.zeros_like(lse)
    return cls(lse, g_loss, zero, zero, zero)

  def map(self, fn) -> RowCotangents:
    """Each through ``fn`` (None stays None)."""
    return RowCotangents(*(None if c is None else fn(c) for c in self))

  def take(self, chunk: Chunk) -> RowCotangents:
    """A chunk's rows of each."""
    return self.map(chunk.take)

  def at_ids_of(self, chunk: Chunk) -> jax.Array | None:
    """A chunk's rows of ``g_at_ids``, 0 in its excluded rows; or None."""
    if self.g_at_ids is None:
      return None
    return jnp.where(chunk.valid[:, None], chunk.take(self.g_at_ids), 0)

  def unit(self, valid: jax.Array, dtype) -> tuple[RowCotangents, jax.Array | None]:
    """``(cotangents, scale)``: the cotangents as ``_plan.unit_weights``."""
    names = ("g_loss", "g_lse", "g_entropy", "g_at_ids")
    given = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
    unit, scale = _plan.unit_weights(tuple(given.values()), valid, dtype)
    return self._replace(**dict(zip(given, unit, strict=True))), scale


@dataclasses.dataclass(frozen=True)
class Differentiated:
  """Which inputs the caller differentiates (static).

  A custom VJP's residuals must have one pytree structure whatever is
  differentiated: JAX caches a forward per pattern of symbolic zeros but keeps
  the residual structure of the latest one it traced, so a pattern-dependent
  structure pairs a cached forward with another pattern's layout (a silently
  zero or mistyped gradient). The flags therefore travel to the backward as
  the shape of an array (``as_residual``), which belongs to the forward that
  actually ran.
  """

  hidden: bool
  weight: bool
  bias: bool

  def as_residual(self) -> np.ndarray:
    """The flags as the shape of a bool array of at most one element."""
    return np.zeros(tuple(int(flag) for flag in self), np.bool_)

  @classmethod
  def from_residual(cls, flags) -> Differentiated:
    """The flags ``as_residual`` wrote."""
    return cls(*(bool(n) for n in flags.shape))

  def fill(self, grads: tuple) -> tuple:
    """``grads`` (None where not differentiated) with an empty array for
    each None, for a residual of one structure; ``unfill`` undoes it."""
    return tuple(np.zeros((0,), np.float32) if g is None else g for g in grads)

  def unfill(self, grads: tuple) -> tuple:
    """The gradients ``fill`` stored: None where not differentiated."""
    return tuple(g if d else None for g, d in zip(grads, self, strict=True))

  def __iter__(self):
    return iter((self.hidden, self.weight, self.bias))


# ---- Compaction: valid rows first. ----


def differentiated(hidden, weight, bias) -> Differentiated:
  """From the ``CustomVJPPrimal`` inputs of a ``symbolic_zeros`` forward."""
  return Differentiated(
    hidden=bool(hidden.perturbed),
    weight=bool(weight.perturbed),
    bias=bias is not None and bool(bias.perturbed),  # None has no leaves to wrap
  )


def scale_gradient(grad, g_loss):
  """A gradient formed for a unit cotangent, times the scalar cotangent
  ``g_loss``: in float32 (``g_loss``'s dtype), rounded once to ``grad``'s."""
  if grad is None:
    return None
  return (grad.astype(g_loss.dtype) * g_loss).astype(grad.dtype)


def unwrap_primals(*primals) -> tuple:
  """The values of ``CustomVJPPrimal`` inputs (None stays None)."""
  return tuple(None if p is None else p.value for p in primals)


def _bits(x: jax.Array) -> jax.Array:
  """16-bit floats as their bits (uint16); other arrays as they are."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x


def _floats(bits: jax.Array, dtype) -> jax.Array:
  return bits if bits.dtype == dtype else lax.bitcast_convert_type(bits, dtype)


# Rows are moved as their bits (XLA:CPU gathers and scatters 16-bit floats
# through a float32 copy of the whole array), with the plain float rule for
# their tangents: a bitcast has none, and the backward pass is differentiated
# again for second derivatives.
@jax.custom_jvp
def _take_rows(array: jax.Array, index: jax.Array) -> jax.Array:
  return _floats(jnp.take(_bits(array), index, axis=0), array.dtype)


@_take_rows.defjvp
def _take_rows_jvp(primals, tangents):
  array, index = primals
  return _take_rows(array, index), jnp.take(tangents[0], index, axis=0)


@jax.custom_jvp
def _set_rows(array: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
  bits = _bits(array).at[index].set(_bits(rows), unique_indices=True)
  return _floats(bits, array.dtype)


@_set_rows.defjvp
def _set_rows_jvp(primals, tangents):
  array, index, rows = primals
  d_array, _, d_rows = tangents
  return _set_rows(*primals), d_array.at[index].set(d_rows, unique_indices=True)


class Permuted(NamedTuple):
  """``array`` seen in the row order ``order`` (``view[i] = array[order[i]]``).

  Chunks gather their rows from it and scatter theirs into it, so the
  ``[N, D]`` hidden states and their gradient are never copied whole into
  compacted order and back.
  """

  array: jax.Array
  order: jax.Array  # int32 [N], a permutation

  @property
  def shape(self) -> tuple[int, ...]:
    return self.array.shape

  @property
  def dtype(self) -> jnp.dtype:
    return self.array.dtype

  def like(self, array: jax.Array) -> Permuted:
    """``array`` seen in the same order."""
    return self._replace(array=array)

  def rows(self, index: jax.Array) -> jax.Array:
    return _take_rows(self.array, index)

  def with_rows(self, index: jax.Array, rows: jax.Array) -> Permuted:
    """Rows ``index`` (distinct) replaced by ``rows``."""
    return self._replace(array=_set_rows(self.array, index, rows.astype(self.dtype)))


def compaction(compact: bool, valid: jax.Array):
  """``(gather, scatter, view)``: into compacted row order and back.

  ``gather`` and ``scatter`` copy (for per-row ``[N]`` arrays); ``view`` wraps
  an ``[N, D]`` array as ``Permuted`` without copying it. Without ``compact``
  all three are the identity.
  """
  if not compact:
    identity = lambda x: x
    return identity, identity, identity
  order = jnp.argsort(jnp.logical_not(valid), stable=True).astype(jnp.int32)
  gather = lambda x: jnp.take(x, order, axis=0)
  scatter = lambda x: jnp.zeros_like(x).at[order].set(x, unique_indices=True)
  return gather, scatter, lambda x: Permuted(x, order)


def original_order(x: jax.Array | Permuted) -> jax.Array:
  """The array of a (possibly ``Permuted``) buffer, in the original row order."""
  return x.array if isinstance(x, Permuted) else x


# ---- Chunks and groups. ----


class Chunk(NamedTuple):
  """A run of consecutive rows: a chunk, or a group of chunks.

  Attributes:
    start: its first row (global).
    offset: its first row within its group (its start, for a group).
    owned: bool ``[size]``: rows no earlier sibling or enclosing group covered.
    local_owned: bool ``[size]``: rows no earlier sibling in the group covered.
    valid: bool ``[size]``: owned rows that count.
    bound: None, or an int32 scalar past its last valid row
      (``with_bound``): its products and kernels stop there, and the rows
      from it on of what they form are unspecified.
  """

  start: jax.Array
  offset: jax.Array
  owned: jax.Array
  local_owned: jax.Array
  valid: jax.Array
  bound: jax.Array | None = None

  @property
  def size(self) -> int:
    return self.owned.shape[0]

  def take(self, x: jax.Array | Permuted) -> jax.Array:
    if isinstance(x, Permuted):
      return x.rows(self.take(x.order))
    return lax.dynamic_slice_in_dim(x, self.start, self.size, axis=0)

  def put(self, buffer, rows: jax.Array, *, local: bool = False):
    """Writes ``rows`` into a global (or, ``local``, a group's) buffer.

    Rows the chunk does not own keep the buffer's value.
    """
    owned, start = (
      (self.local_owned, self.offset) if local else (self.owned, self.start)
    )
    mask = owned.reshape(owned.shape + (1,) * (rows.ndim - 1))
    if isinstance(buffer, Permuted):  # the chunk's rows are distinct: in place
      if local:
        raise ValueError("a Permuted buffer holds all rows, not a group's")
      index = self.take(buffer.order)
      return buffer.with_rows(index, jnp.where(mask, rows, buffer.rows(index)))
    old = lax.dynamic_slice_in_dim(buffer, start, self.size, axis=0)
    return lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, rows, old), start, 0)

  def hidden(self, hidden: jax.Array | Permuted) -> jax.Array:
    """The chunk's hidden rows, excluded rows zeroed: they never leak."""
    h = self.take(hidden)
    return jnp.where(self.valid[:, None], h, jnp.zeros_like(h))


def chunk_of(
  size: int, valid: jax.Array, index: jax.Array, group: Chunk | None = None
) -> Chunk:
  """Chunk ``index`` of ``size`` rows of ``valid`` (all rows, or ``group``'s).

  The last chunk is clamped to end at the last row and owns only the rows the
  previous chunk did not cover.
  """
  n_rows = valid.shape[0]
  offset = jnp.minimum(index * size, n_rows - size)
  local_owned = offset + jnp.arange(size) >= index * size
  owned, start = local_owned, offset
  if group is not None:
    owned = local_owned & lax.dynamic_slice_in_dim(group.owned, offset, size)
    start = group.start + offset
  chunk_valid = lax.dynamic_slice_in_dim(valid, offset, size) & local_owned
  return Chunk(start, offset, owned, local_owned, chunk_valid)


# A chunk's bound is a multiple of this many rows (or its size): the Mosaic
# GEMM contracts over rows in steps of 64 (``GemmConfig.tile_k``), which
# then read no row past the bound, and every kernel forms the rows before it.
BOUND_ROWS = 64


def with_bound(chunk: Chunk) -> Chunk:
  """``chunk`` with its ``bound``: one past its last valid row, rounded up
  to a multiple of ``BOUND_ROWS`` (at most its size; 0 without a valid row).

  With valid rows compacted to the front, a group's valid rows end where
  the valid rows of all rows do, and the group's products run to there
  only, at one shape for every count of valid rows (``_gemm.matmul``).
  """
  valid = chunk.valid
  last = chunk.size - jnp.argmax(valid[::-1])
  bound = jnp.minimum(-(-last // BOUND_ROWS) * BOUND_ROWS, chunk.size)
  bound = jnp.where(jnp.any(valid), bound, 0).astype(jnp.int32)
  return chunk._replace(bound=bound)


Update = Callable[[Any, Chunk], Any]
# Per-row (loss, lse, correct, entropy), each [N].
Outputs = tuple[jax.Array, ...]  # and, with ids, [N, K] logits at them
# (dhidden, dweight, dbias); None where an input is not differentiated.
Grads = tuple[Any, jax.Array | None, jax.Array | None]


def sweep_chunks(
  size: int,
  valid: jax.Array,
  update: Update,
  carry,
  *,
  group: Chunk | None = None,
  visit: Callable[[Chunk], jax.Array] | None = None,
  bounded: bool = False,
):
  """``carry = update(carry, chunk)`` for every chunk of ``size`` rows to visit.

  Walks the rows of ``valid`` (all rows, or those of ``group``) in chunks
  (``chunk_of``; ``bounded``: ``with_bound``). A chunk without a valid row
  (or, with ``visit``, one where ``visit(chunk)`` is false) is skipped by
  ``lax.cond`` on a device-side predicate (the carry passes through). One
  chunk of all the rows, unbounded, runs unconditionally (its excluded rows
  count for nothing): the cond would carry ``[V, D]`` ``dweight`` at the top
  of the program, where XLA may copy it (a weight-sized temporary beyond the
  budget).
  """
  bound = with_bound if bounded else lambda chunk: chunk
  chunk_at = lambda index: bound(chunk_of(size, valid, index, group))
  if size >= valid.shape[0] and visit is None and not bounded:
    return update(_manual_axes.like(carry, valid), chunk_at(0))
  visit = visit or (lambda chunk: jnp.any(chunk.valid))
  skipped = lambda carry, chunk: carry

  def body(carry, index):
    chunk = chunk_at(index)
    return lax.cond(visit(chunk), update, skipped, carry, chunk), None

  indices = jnp.arange(-(-valid.shape[0] // size))
  carry = _manual_axes.like(carry, valid)
  carry, _ = lax.scan(body, carry, indices)
  return carry


# ---- Outputs and gradient accumulators. ----


def output_init(n_rows: int, dtype: jnp.dtype, ids: jax.Array | None = None):
  """Per-row ``(loss, lse, correct, entropy)`` buffers, and ``[N, K]`` logits
  at ``ids`` when there are ids; excluded rows stay zero."""
  at_ids = () if ids is None else (jnp.zeros(ids.shape, dtype),)
  return (
    jnp.zeros((n_rows,), dtype),
    jnp.zeros((n_rows,), dtype),
    jnp.zeros((n_rows,), bool),
    jnp.zeros((n_rows,), dtype),
    *at_ids,
  )


def stat_dtype(hidden) -> jnp.dtype:
  """The per-row statistics' dtype: float32, or float64 for float64 inputs."""
  return ce_math.at_least_float32(hidden.dtype)


def _zeros_if(flag: bool, shape, dtype):
  return jnp.zeros(shape, dtype) if flag else None


def gradient_init(config, x, diff: Differentiated) -> Grads:
  """Zero ``(dhidden, dweight, dbias)`` accumulators (None: not differentiated).

  ``config``: what holds the accumulators' dtypes (``dweight_dtype``,
  ``dbias_dtype``): a ``SweepConfig``, or the distillation's plan. ``x``: the
  sweep's arrays (``hidden``, ``weight``, ``bias``). ``dhidden`` is
  ``Permuted`` like ``hidden``.
  """
  hidden, weight, bias = x.hidden, x.weight, x.bias
  dhidden = _zeros_if(diff.hidden, hidden.shape, hidden.dtype)
  if dhidden is not None and isinstance(hidden, Permuted):
    dhidden = hidden.like(dhidden)
  return (
    dhidden,
    _zeros_if(diff.weight, weight.shape, config.dweight_dtype),
    _zeros_if(diff.bias, bias.shape if diff.bias else None, config.dbias_dtype),
  )


def gradient_finish(
  grads: Grads, x: RowInputs, scale: jax.Array | None = None
) -> Grads:
  """The accumulators in their inputs' dtypes (and ``dhidden`` in row order),
  times ``scale`` where they hold unscaled sums (``_plan.finished``)."""
  (dhidden, dweight, dbias), weight, bias = grads, x.weight, x.bias
  if dhidden is not None:
    dhidden = original_order(dhidden)
  if dweight is not None:
    dweight = _plan.finished(dweight, weight.dtype, scale)
  if dbias is not None:
    dbias = _plan.finished(dbias, bias.dtype, scale)
  return dhidden, dweight, dbias
