"""The loss over a device mesh: rows over a batch axis, vocabulary over a model axis.

``linear_cross_entropy(..., mesh=mesh, batch_axis="data", vocab_axis="model")``
runs the chunked driver on every device inside ``jax.shard_map``:

* **Data parallel** (``batch_axis``): each device holds a slice of the rows and
  the whole weight; ``dweight`` and ``dbias`` are summed over the batch axis
  (``psum``).
* **Vocab parallel** (``vocab_axis``, Megatron style): each device holds a
  ``[V / m, D]`` slice of the weight. Per chunk it forms only its shard's
  logits; ``VocabShardedCE`` combines the row statistics across the model
  axis (``pmax`` of the row max, ``psum`` of the rescaled sum-exp, the target
  logit from the shard that holds the label, ``pmin`` for the first argmax),
  so every device sees the global lse. ``dlogits`` stay local, ``dhidden`` is
  summed over the model axis, ``dweight`` stays sharded. No weight all-gather
  and no ``[N, V]`` array anywhere.

The custom VJPs are the single-device ones (``chunked.row_losses`` and
``chunked.reduced_loss``) with a ``Plan`` whose three computations are
``shard_map``-ped, so ``shard_map`` itself is never differentiated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mst_jax import ce_math, chunked
from mst_jax.backends import ChunkCE, base


@dataclasses.dataclass(frozen=True)
class VocabShardedCE:
  """A ``ChunkCE`` on one vocabulary shard, with statistics combined over ``axis``.

  Attributes:
    inner: the backend that reduces this device's ``[rows, V / m]`` logits
      (or, with ``vocab_block_size``, blocks of them).
    axis: the mesh axis the vocabulary is split over.
    shard_size: ``V / m``.
    vocab_size: ``V``.
  """

  inner: ChunkCE
  axis: str
  shard_size: int
  vocab_size: int
  name: str = "vocab-sharded"

  def local_labels(self, labels):
    """Labels as this shard's column indices (outside ``[0, shard_size)``: not here)."""
    return labels - lax.axis_index(self.axis) * self.shard_size

  def combine(self, stats, local_labels):
    """Whole-row statistics from each shard's, over the model axis.

    ``stats`` reduce this shard's ``shard_size`` columns with ``local_labels``
    (``inner.forward``, or ``mst_jax.vocab_blocked`` merging the shard's
    blocks first, so that the collectives run once per chunk).
    """
    here = (local_labels >= 0) & (local_labels < self.shard_size)
    reduce = lambda collective: functools.partial(collective, axis_name=self.axis)
    return ce_math.combine_stats(
      stats,
      here,
      lax.axis_index(self.axis) * self.shard_size,
      jnp.float32(self.shard_size),
      self.vocab_size,
      reduce_max=reduce(lax.pmax),
      reduce_sum=reduce(lax.psum),
      reduce_min=reduce(lax.pmin),
    )

  def forward(self, logits, labels, options):
    local = self.local_labels(labels)
    return self.combine(self.inner.forward(logits, local, options), local)

  def backward(self, logits, labels, rows, options, out_dtype, vocab_size=None):
    """``dlogits`` of this shard's columns (or a block of them: the inner
    backend compares columns with the labels as given, less the shard offset)."""
    del vocab_size  # always the whole vocabulary's
    return self.inner.backward(
      logits,
      self.local_labels(labels),
      rows,
      options,
      out_dtype,
      vocab_size=self.vocab_size,
    )

  def forward_backward(
    self, logits, labels, valid, g_loss, options, out_dtype, *, into=None
  ):
    return base.unfused_forward_backward(
      self, logits, labels, valid, g_loss, options, out_dtype, into, self.vocab_size
    )


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where the arrays live on the mesh (static, hashable)."""

  mesh: jax.sharding.Mesh
  batch_axis: str | None
  vocab_axis: str | None
  weight_layout: str

  @property
  def rows(self):
    return P(self.batch_axis)

  @property
  def hidden(self):
    return P(self.batch_axis, None)

  @property
  def weight(self):
    if self.weight_layout == "vd":
      return P(self.vocab_axis, None)
    return P(None, self.vocab_axis)

  @property
  def bias(self):
    return P(self.vocab_axis)

  def constrain(self, x, spec):
    """Puts ``x`` where ``spec`` says (reshard on Explicit meshes)."""
    sharding = NamedSharding(self.mesh, spec)
    if AxisType.Explicit in tuple(self.mesh.axis_types):
      return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)

  def shard_map(self, fn, args, in_specs, out_specs):
    args = [self.constrain(x, s) for x, s in zip(args, in_specs, strict=True)]
    mapped = jax.shard_map(
      fn,
      mesh=self.mesh,
      in_specs=tuple(in_specs),
      out_specs=out_specs,
      check_vma=False,
    )
    return mapped(*args)

  def sum_over(self, x, axis):
    return x if x is None or axis is None else lax.psum(x, axis)


def _bias_args(bias, layout):
  """``bias`` and its spec, or nothing: shard_map takes no None arguments."""
  return ([bias], [layout.bias]) if bias is not None else ([], [])


def _with_bias(fn, has_bias):
  """``fn(h, w, bias, *rest)`` called with a bias argument only if there is one."""
  if has_bias:
    return fn
  return lambda h, w, *rest: fn(h, w, None, *rest)


def _sharded_forward(layout, local, config, hidden, weight, bias, labels, valid):
  bias_args, bias_specs = _bias_args(bias, layout)
  body = _with_bias(functools.partial(local.forward, config), bias is not None)
  return layout.shard_map(
    body,
    [hidden, weight, *bias_args, labels, valid],
    [layout.hidden, layout.weight, *bias_specs, layout.rows, layout.rows],
    (layout.rows, layout.rows, layout.rows),
  )


def _grad_specs(layout, diff):
  return (
    layout.hidden if diff.hidden else None,
    layout.weight if diff.weight else None,
    layout.bias if diff.bias else None,
  )


def _reduce_grads(layout, grads):
  """Partial gradients to whole ones: dhidden over the vocabulary shards,
  dweight and dbias over the row shards."""
  dhidden, dweight, dbias = grads
  return (
    layout.sum_over(dhidden, layout.vocab_axis),
    layout.sum_over(dweight, layout.batch_axis),
    layout.sum_over(dbias, layout.batch_axis),
  )


def _sharded_backward(
  layout, local, config, hidden, weight, bias, labels, valid, lse, g_loss, g_lse, diff
):
  bias_args, bias_specs = _bias_args(bias, layout)

  def body(h, w, b, y, v, s, gl, gs):
    grads = local.backward(config, h, w, b, y, v, s, gl, gs, diff)
    return _reduce_grads(layout, grads)

  rows = layout.rows
  return layout.shard_map(
    _with_bias(body, bias is not None),
    [hidden, weight, *bias_args, labels, valid, lse, g_loss, g_lse],
    [layout.hidden, layout.weight, *bias_specs, rows, rows, rows, rows, rows],
    _grad_specs(layout, diff),
  )


def _sharded_fused(
  layout, local, config, hidden, weight, bias, labels, valid, row_scale, diff
):
  bias_args, bias_specs = _bias_args(bias, layout)

  def body(h, w, b, y, v, scale):
    (loss, lse, correct), grads = local.fused(config, h, w, b, y, v, scale, diff)
    return (layout.sum_over(loss, layout.batch_axis), lse, correct), _reduce_grads(
      layout, grads
    )

  rows = layout.rows
  return layout.shard_map(
    _with_bias(body, bias is not None),
    [hidden, weight, *bias_args, labels, valid, row_scale],
    [layout.hidden, layout.weight, *bias_specs, rows, rows, rows],
    ((P(), rows, rows), _grad_specs(layout, diff)),
  )


def plan_for(local: chunked.Plan, layout: Layout) -> chunked.Plan:
  """``local`` (a single-device plan) run per device on ``layout.mesh``.

  With a vocabulary axis, the config's backend is wrapped in ``VocabShardedCE``.
  """
  config = local.config
  if layout.vocab_axis is not None:
    vocab_size = config.vocab_total
    shard = vocab_size // layout.mesh.shape[layout.vocab_axis]
    config = dataclasses.replace(
      config,
      backend=VocabShardedCE(config.backend, layout.vocab_axis, shard, vocab_size),
    )
  return chunked.Plan(
    config,
    functools.partial(_sharded_forward, layout, local),
    functools.partial(_sharded_backward, layout, local),
    functools.partial(_sharded_fused, layout, local),
  )
