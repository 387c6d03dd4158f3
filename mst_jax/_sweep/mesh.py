"""The loss over a device mesh: rows over a batch axis, vocabulary over a model axis.

``linear_cross_entropy(..., mesh=mesh, batch_axis="data", vocab_axis="model")``
runs a loop order on every device inside ``jax.shard_map`` (``Sharded``):

* **Data parallel** (``batch_axis``): each device holds a slice of the rows and
  the whole weight; ``dweight`` and ``dbias`` are summed over the batch axis
  (``psum``).
* **Vocab parallel** (``vocab_axis``, Megatron style): each device holds a
  ``[V / m, D]`` slice of the weight. Per chunk it forms only its shard's
  logits; ``VocabShard`` (the ``Columns`` of the sweep's configuration)
  combines the row statistics across the model axis (``pmax`` of the row max,
  ``psum`` of the rescaled sum-exp, the target logit from the shard that holds
  the label, ``pmin`` for the first argmax), so every device sees the global
  lse. ``dlogits`` stay local, ``dhidden`` is summed over the model axis,
  ``dweight`` stays sharded. No weight all-gather and no ``[N, V]`` array
  anywhere.

The custom VJPs are the single-device ones (``_sweep.driver``) with a loop order
whose three computations are ``shard_map``-ped, so ``shard_map`` itself is
never differentiated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mst_jax._args import inputs as _inputs
from mst_jax._args.inputs import Rows
from mst_jax._gemm import matmul
from mst_jax._math import ce as ce_math
from mst_jax._sweep.driver import LoopOrder
from mst_jax._sweep.rows import Differentiated, Grads, RowCotangents, RowInputs

# Rows of a vocab-parallel partial sum all-reduced at a time (``sum_partial``).
_SUM_PIECE_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class VocabShard:
  """``Columns`` of one vocabulary shard, combined over the mesh axis ``axis``.

  Attributes:
    axis: the mesh axis the vocabulary is split over.
    shard_size: ``V / m``.
    vocab_size: ``V``.
  """

  axis: str
  shard_size: int
  vocab_size: int
  split = True

  def offset(self) -> jax.Array:
    return lax.axis_index(self.axis) * self.shard_size

  def combine(self, stats: ce_math.RowStats, labels: jax.Array) -> ce_math.RowStats:
    """Whole-row statistics from each shard's (``stats`` relative to the shard)."""
    offset = self.offset()
    local = labels - offset
    here = (local >= 0) & (local < self.shard_size)
    reduce = lambda collective: functools.partial(collective, axis_name=self.axis)
    return ce_math.combine_stats(
      stats,
      here,
      offset,
      jnp.float32(self.shard_size),
      self.vocab_size,
      # The max only shifts the sum-exp (the lse does not depend on it), and
      # pmax has no derivative: second derivatives go through the rest.
      reduce_max=lambda x: lax.pmax(lax.stop_gradient(x), self.axis),
      reduce_sum=reduce(lax.psum),
      reduce_min=reduce(lax.pmin),
    )

  def sum_partial(self, x: jax.Array) -> jax.Array:
    """``psum`` of ``x`` over the shards, in row pieces written back over ``x``.

    A group's ``dhidden`` rows (64 MiB at 8192 x 4096 bf16) summed whole would
    be held twice, before and after the all-reduce; summed a piece at a time
    in place, the second copy is one piece.
    """
    piece = max(1, _SUM_PIECE_BYTES // (math.prod(x.shape[1:]) * x.dtype.itemsize))
    whole = x.shape[0] // piece
    if whole <= 1:
      return lax.psum(x, self.axis)

    def sum_piece(i, x):
      start = i * piece
      rows = lax.dynamic_slice_in_dim(x, start, piece, axis=0)
      return lax.dynamic_update_slice_in_dim(x, lax.psum(rows, self.axis), start, 0)

    x = lax.fori_loop(0, whole, sum_piece, x)
    if (tail := whole * piece) < x.shape[0]:
      x = x.at[tail:].set(lax.psum(x[tail:], self.axis))
    return x


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the arrays live on the mesh (static, hashable)."""

  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
  batch_axis: str | tuple[str, ...] | None
  vocab_axis: str | tuple[str, ...] | None
  weight_layout: str
  from_inputs: bool = False  # read off inputs typed on an Explicit mesh

  @property
  def rows(self) -> P:
    return P(self.batch_axis)

  @property
  def hidden(self) -> P:
    return P(self.batch_axis, None)

  @property
  def weight(self) -> P:
    if self.weight_layout == "vd":
      return P(self.vocab_axis, None)
    return P(None, self.vocab_axis)

  @property
  def bias(self) -> P:
    return P(self.vocab_axis)

  def axis_size(self, axis: str | tuple[str, ...] | None) -> int:
    return math.prod(self.mesh.shape[name] for name in _names(axis))

  @property
  def platform(self) -> str:
    if isinstance(self.mesh, jax.sharding.Mesh):
      return self.mesh.devices.flat[0].platform
    return self.mesh.abstract_device.platform

  def constrain(self, x: jax.Array, spec: P) -> jax.Array:
    """Puts ``x`` where ``spec`` says (reshard on Explicit meshes)."""
    sharding = NamedSharding(self.mesh, spec)
    if AxisType.Explicit in tuple(self.mesh.axis_types):
      return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)

  def sum_over(self, x, axis: str | None):
    return x if x is None or axis is None else lax.psum(x, axis)

  def reduce_grads(self, grads: Grads) -> Grads:
    """Per-device gradients to whole ones: ``dweight`` and ``dbias`` summed over
    the row shards (``dhidden`` rows are summed over the vocabulary shards as
    they are formed: ``VocabShard.sum_partial``)."""
    dhidden, dweight, dbias = grads
    return (
      dhidden,
      self.sum_over(dweight, self.batch_axis),
      self.sum_over(dbias, self.batch_axis),
    )

  def grad_specs(self, diff: Differentiated) -> tuple[P | None, P | None, P | None]:
    return (
      self.hidden if diff.hidden else None,
      self.weight if diff.weight else None,
      self.bias if diff.bias else None,
    )

  @property
  def logits(self) -> P:
    """A ``[N, V]`` array's shards: rows over the batch axis, columns over
    the vocabulary axis."""
    return P(self.batch_axis, self.vocab_axis)

  def per_device(
    self, fn: Callable, x: RowInputs, extra: tuple, out_specs, extra_specs=None
  ):
    """``fn(x, *extra)`` on each device's shards.

    ``extra`` are ``[N]`` arrays split like the rows, unless ``extra_specs``
    says otherwise. Fields of ``x`` that are None (no bias, no class weights)
    are not passed through ``shard_map`` (which takes arrays only).
    """
    field_specs = RowInputs(
      hidden=self.hidden,
      weight=self.weight,
      bias=self.bias,
      labels=self.rows,
      valid=self.rows,
      class_weights=self.bias,
      target_weight=self.rows,
      mean_weight=self.rows,
      ids=self.rows,
    )
    n_fields = len(field_specs)
    return self.map_devices(
      lambda *arrays: fn(RowInputs(*arrays[:n_fields]), *arrays[n_fields:]),
      [*x, *extra],
      [*field_specs, *(extra_specs or [self.rows] * len(extra))],
      out_specs,
    )

  def map_devices(self, fn: Callable, arrays: Sequence, specs: Sequence, out_specs):
    """``fn(*arrays)`` on each device's shards (``specs``, one per array);
    arrays that are None pass by ``shard_map``, which takes arrays only."""
    present = [a is not None for a in arrays]
    given_specs = [s for s, p in zip(specs, present, strict=True) if p]

    def body(*given):
      given = iter(given)
      return fn(*[next(given) if p else None for p in present])

    mapped = jax.shard_map(
      body,
      mesh=self.mesh,
      in_specs=tuple(given_specs),
      out_specs=out_specs,
      # The bodies mix per-device values with collectives' results freely
      # (dhidden is psum-ed only with a vocab axis, say); the specs above
      # state every output's sharding, so the varying-axes check adds nothing.
      check_vma=False,
    )
    given = [a for a in arrays if a is not None]
    return mapped(
      *(self.constrain(a, s) for a, s in zip(given, given_specs, strict=True))
    )


@dataclasses.dataclass(frozen=True)
class Sharded:
  """A loop order run per device on ``layout.mesh`` (a ``driver.LoopOrder`` itself)."""

  inner: LoopOrder
  layout: Layout

  def _row_specs(self, x) -> tuple:
    """The per-row outputs' shards: ``(loss, lse, correct, entropy)``, and
    the logits at ``x.ids`` when there are ids."""
    return (self.layout.rows,) * (4 if x.ids is None else 5)

  def forward(self, config, x):
    forward = functools.partial(self.inner.forward, config)
    return self.layout.per_device(forward, x, (), self._row_specs(x))

  def backward(self, config, x, cot, diff):
    def body(x, *cot):
      grads = self.inner.backward(config, x, RowCotangents(*cot), diff)
      return self.layout.reduce_grads(grads)

    return self.layout.per_device(body, x, tuple(cot), self.layout.grad_specs(diff))

  def forward_keeping(self, config, x):
    forward = functools.partial(self.inner.forward_keeping, config)
    out_specs = (self._row_specs(x), self.layout.logits)
    return self.layout.per_device(forward, x, (), out_specs)

  def backward_kept(self, config, x, cot, diff, logits):
    def body(x, logits, *cot):
      grads = self.inner.backward_kept(config, x, RowCotangents(*cot), diff, logits)
      return self.layout.reduce_grads(grads)

    layout = self.layout
    extra_specs = (layout.logits, *(layout.rows,) * len(cot))
    out_specs = layout.grad_specs(diff)
    return layout.per_device(body, x, (logits, *cot), out_specs, extra_specs)

  def fused(self, config, x, row_scale, diff):
    layout = self.layout

    def body(x, row_scale):
      (loss, *per_row), grads = self.inner.fused(config, x, row_scale, diff)
      loss = layout.sum_over(loss, layout.batch_axis)
      return (loss, *per_row), layout.reduce_grads(grads)

    out_specs = ((P(), *(layout.rows,) * 3), layout.grad_specs(diff))
    return layout.per_device(body, x, (row_scale,), out_specs)


def row_devices(layout: Layout | None) -> int:
  """The devices the rows are split over (each holds one block of them)."""
  return 1 if layout is None else layout.axis_size(layout.batch_axis)


def _names(axis) -> tuple[str, ...]:
  if axis is None:
    return ()
  return (axis,) if isinstance(axis, str) else tuple(axis)


def layout_for(
  mesh,
  batch_axis: str | None,
  vocab_axis: str | None,
  weight_layout: str,
  rows: Rows,
) -> Layout | None:
  """The ``Layout`` for a mesh, after checks; without one, the layout the
  rows are typed with on an Explicit mesh (else None)."""
  n_rows, vocab_size = rows.hidden.shape[0], rows.vocab_size
  if mesh is None:
    if (batch_axis, vocab_axis) != (None, None):
      raise ValueError("batch_axis and vocab_axis name axes of a mesh: pass mesh=.")
    return _from_inputs(rows, weight_layout)
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if batch_axis is None and vocab_axis is None:
    raise ValueError("with a mesh, give batch_axis, vocab_axis or both.")
  if batch_axis is not None and batch_axis == vocab_axis:
    raise ValueError(f"batch_axis and vocab_axis must differ, both are {batch_axis!r}.")
  for name, axis in (("batch_axis", batch_axis), ("vocab_axis", vocab_axis)):
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}.")
  if _inputs.explicit_mesh(rows.hidden, rows.weight) is None:
    mesh = _auto(mesh)
  layout = Layout(mesh, batch_axis, vocab_axis, weight_layout)
  if n_rows % layout.axis_size(batch_axis):
    raise ValueError(
      f"the {n_rows} tokens must split evenly over batch_axis={batch_axis!r}"
      f" ({layout.axis_size(batch_axis)} devices)."
    )
  if vocab_size % layout.axis_size(vocab_axis):
    raise ValueError(
      f"the vocabulary ({vocab_size}) must split evenly over vocab_axis={vocab_axis!r}"
      f" ({layout.axis_size(vocab_axis)} devices): use a mesh axis whose size"
      " divides V. Padding the weight changes the loss unless the padded"
      " columns get a bias of -inf and there is no label smoothing (its"
      " eps / V and mean logit count every column)."
    )
  return layout


def _auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """``mesh`` with Auto axes, for inputs typed on no Explicit mesh: on Explicit
  axes the outputs' types would carry the mesh, and ``jax.grad`` outside
  ``jax.set_mesh`` cannot form their cotangents."""
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _from_inputs(rows: Rows, weight_layout: str) -> Layout | None:
  """The layout of rows on an Explicit mesh (``_args.inputs.prepare`` resharded
  them to one this module runs), or None off such a mesh.

  An axis that does not split its dimension evenly is dropped (that
  dimension is then gathered).
  """
  mesh = _inputs.explicit_mesh(rows.hidden, rows.weight)
  if mesh is None:
    return None
  vocab = _inputs.spec_entry(rows.weight, matmul.vocab_axis(weight_layout))
  layout = Layout(
    mesh, _inputs.spec_entry(rows.hidden, 0), vocab, weight_layout, from_inputs=True
  )
  if rows.hidden.shape[0] % layout.axis_size(layout.batch_axis):
    layout = dataclasses.replace(layout, batch_axis=None)
  if rows.vocab_size % layout.axis_size(layout.vocab_axis):
    layout = dataclasses.replace(layout, vocab_axis=None)
  # With neither split, still per device: inside shard_map no array is typed
  # on the mesh, and the loop orders' fresh buffers need not be either.
  return layout


def gathered(rows: Rows) -> Rows:
  """``rows`` whole on every device of their Explicit mesh."""
  mesh = _inputs.explicit_mesh(rows.hidden, rows.weight)
  whole = lambda x: jax.sharding.reshard(x, NamedSharding(mesh, P()))
  return Rows(*(whole(f) if isinstance(f, jax.Array) else f for f in rows))
