"""Validation and shaping shared by every implementation.

Everything here runs at trace time on static shapes and dtypes: bad input
raises before anything is computed. ``prepare`` turns the public arguments into
rows (``[N, D]`` hidden, ``[N]`` labels and validity); ``finalize`` turns
per-row outputs back into the reduced loss and its aux values. The
implementations in between see only rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mst_jax import _manual_axes, _plan
from mst_jax._args.options import LossOptions, check_choice
from mst_jax._gemm import matmul
from mst_jax._math.ce import at_least_float32


class LossAux(NamedTuple):
  """Auxiliary outputs of ``linear_cross_entropy(..., return_aux=True)``.

  Attributes:
    lse: float32, shape of ``labels``: each token's log-sum-exp of the
      (scaled, softcapped) logits; 0 at excluded tokens. Differentiable
      unless ``grad_mode="fused"`` (the default for a scalar loss over at
      least D rows a device), which raises if it is differentiated.
    n_valid: int32 scalar, the number of tokens that count.
    z_loss: float32, the z-loss term included in the loss, reduced (and
      token-weighted) like it.
    n_correct: int32 scalar, valid tokens whose argmax equals the label.
  """

  lse: jax.Array
  n_valid: jax.Array
  z_loss: jax.Array
  n_correct: jax.Array


class Rows(NamedTuple):
  """The public arguments as rows.

  Attributes:
    hidden: ``[N, D]`` in the compute dtype.
    weight: the weight in the compute dtype, layout unchanged.
    bias: ``[V]`` or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``: not ``ignore_index``, ``where`` True, and (with
      ``shift``) not the last position of a sequence.
    batch_shape: the shape of ``labels`` (per-token outputs take it back).
    vocab_size: ``V``.
    token_weights: float ``[N]`` (shifted with the labels), not
      differentiated; or None.
    class_weights: ``[V]`` float32 (float64 for float64 inputs), not
      differentiated; or None (also with class weights, on the chunked paths
      without label smoothing: ``for_chunks``).
    target_weight: float32 ``[N]``, each row's label's class weight (0 where
      the label is outside ``[0, V)``), with class weights; else None.
    mean_weight: float32 ``[N]``, the mean class weight, likewise.
    ids: int32 ``[N, K]`` ids in ``[0, V)`` whose logits the sweep also gives
      (``linear_log_probs`` at several ids a position), or None.
  """

  hidden: jax.Array
  weight: jax.Array
  bias: jax.Array | None
  labels: jax.Array
  valid: jax.Array
  batch_shape: tuple[int, ...]
  vocab_size: int
  token_weights: jax.Array | None = None
  class_weights: jax.Array | None = None
  target_weight: jax.Array | None = None
  mean_weight: jax.Array | None = None
  ids: jax.Array | None = None

  @property
  def arrays(self) -> tuple:
    """``(hidden, weight, bias, labels, valid)``, then ``(class_weights,
    target_weight, mean_weight)`` (None without class weights) when there
    are class weights or ids, and ``ids`` when there are ids: the
    ``_sweep.rows.RowInputs`` fields."""
    arrays = (self.hidden, self.weight, self.bias, self.labels, self.valid)
    if self.target_weight is None and self.ids is None:
      return arrays
    arrays = (*arrays, self.class_weights, self.target_weight, self.mean_weight)
    return arrays if self.ids is None else (*arrays, self.ids)

  def for_chunks(self, label_smoothing: float) -> Rows:
    """These rows for the chunked paths. Without label smoothing a class
    weight scales its label's term alone, which ``target_weight`` carries
    (``ce_math.backward_rows``): the ``[V]`` weights stay out, and every
    backend takes the rows."""
    _plan.require_concrete(self.hidden, self.weight)
    if label_smoothing:
      return self
    return self._replace(class_weights=None)


def _check_float(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}.")


def prepare(
  hidden: jax.Array,
  weight: jax.Array,
  labels: jax.Array,
  bias: jax.Array | None,
  where: jax.Array | None,
  options: LossOptions,
  weight_layout: str,
  token_weights: jax.Array | None = None,
  class_weights: jax.Array | None = None,
) -> Rows:
  """Validates the public arguments and flattens them into rows."""
  if labels is None:
    raise TypeError(
      "labels is None: pass int labels with hidden's leading shape (use"
      " ignore_index or where= to exclude tokens)."
    )
  hidden, weight, labels = map(jnp.asarray, (hidden, weight, labels))
  check_choice("weight_layout", weight_layout, matmul.WEIGHT_LAYOUTS)
  _check_float("hidden", hidden)
  _check_float("weight", weight)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must have an integer dtype, got {labels.dtype}.")
  if hidden.ndim < 2:
    raise ValueError(f"hidden must be [N, D] or [..., T, D], got shape {hidden.shape}.")
  if weight.ndim != 2:
    raise ValueError(f"weight must be 2-D, got shape {weight.shape}.")
  vocab_axis = matmul.vocab_axis(weight_layout)
  vocab_size, dim = weight.shape[vocab_axis], weight.shape[1 - vocab_axis]
  if hidden.shape[-1] != dim:
    hint = ""
    if hidden.shape[-1] == vocab_size:
      other = "dv" if weight_layout == "vd" else "vd"
      hint = (
        f" If the weight is {'[D, V]' if other == 'dv' else '[V, D]'}, pass"
        f" weight_layout={other!r}; if hidden holds logits, pass the hidden"
        " states before the head instead."
      )
    raise ValueError(
      f"hidden's last axis ({hidden.shape[-1]}) must equal the weight's D axis:"
      f" hidden {hidden.shape}, weight {weight.shape} with"
      f" weight_layout={weight_layout!r} ({'[V, D]' if vocab_axis == 0 else '[D, V]'})."
      + hint
    )
  if vocab_size == 0:
    raise ValueError(f"the vocabulary is empty: weight {weight.shape}.")
  if dim == 0:
    raise ValueError(f"the hidden size D is 0: hidden {hidden.shape}.")
  if labels.shape != hidden.shape[:-1]:
    shifted = (
      labels.ndim >= 1
      and labels.shape[:-1] == hidden.shape[:-2]
      and labels.shape[-1] == hidden.shape[-2] - 1
    )
    hint = (
      " These labels are one position short, as already-shifted labels are:"
      " pass the unshifted labels with shift=True (position t then predicts"
      " labels[..., t + 1])."
      if shifted
      else ""
    )
    raise ValueError(
      f"labels shape {labels.shape} must equal hidden's leading shape"
      f" {hidden.shape[:-1]} (hidden {hidden.shape}).{hint}"
    )
  if bias is not None:
    bias = jnp.asarray(bias)
    _check_float("bias", bias)
    if bias.shape != (vocab_size,):
      raise ValueError(f"bias must have shape ({vocab_size},), got {bias.shape}.")
  if where is not None:
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"where must be a bool array, got dtype {where.dtype}.")
    if where.shape != labels.shape:
      raise ValueError(
        f"where shape {where.shape} must equal labels shape {labels.shape}."
      )
  if token_weights is not None:
    token_weights = lax.stop_gradient(jnp.asarray(token_weights))  # data
    _check_float("token_weights", token_weights)
    if token_weights.shape != labels.shape:
      raise ValueError(
        f"token_weights shape {token_weights.shape} must equal labels shape"
        f" {labels.shape}."
      )

  # The wider of the two (numpy's rule: JAX's strict promotion mode has none
  # between bfloat16 and float32): float32 hidden and a bfloat16 weight
  # compute in float32.
  if class_weights is not None:
    class_weights = lax.stop_gradient(jnp.asarray(class_weights))  # data
    _check_float("class_weights", class_weights)
    if class_weights.shape != (vocab_size,):
      raise ValueError(
        f"class_weights must have shape ({vocab_size},), got {class_weights.shape}."
      )

  mesh = explicit_mesh(
    hidden, weight, labels, bias, where, token_weights, class_weights
  )
  if mesh is not None:
    hidden, weight, labels, bias, where, token_weights, class_weights = _as_rows_on(
      mesh,
      vocab_axis,
      hidden,
      weight,
      labels,
      bias,
      where,
      token_weights,
      class_weights,
    )
  dtype = np.promote_types(hidden.dtype, weight.dtype)
  hidden, weight = hidden.astype(dtype), weight.astype(dtype)
  if class_weights is not None:  # in the loss's dtype: float64 for float64 inputs
    class_weights = class_weights.astype(np.promote_types(dtype, np.float32))
  ignore_index = options.ignore_index
  labels, valid = int32_labels(labels, vocab_size, ignore_index)
  if where is not None:
    valid = valid & where
  if options.shift:
    # Position t predicts label t + 1; the last position predicts nothing.
    # where and token_weights, like the labels, refer to label positions.
    labels, valid = (shift(x, fill) for x, fill in ((labels, vocab_size), (valid, 0)))
    if token_weights is not None:
      token_weights = shift(token_weights, 0)
  batch_shape = labels.shape
  classes = {}
  if class_weights is not None:
    flat = labels.reshape(-1)
    in_range = (flat >= 0) & (flat < vocab_size)
    index = jnp.clip(flat, 0, vocab_size - 1)
    # On Explicit axes the gather's output is typed like the (row) labels.
    sharding = jax.typeof(flat).sharding if explicit_mesh(flat) else None
    target = class_weights.at[index].get(out_sharding=sharding)
    target = jnp.where(in_range, target, 0.0)
    mean = jnp.full(flat.shape, jnp.mean(class_weights))
    classes = dict(class_weights=class_weights, target_weight=target, mean_weight=mean)
  rows = Rows(
    hidden=hidden.reshape(-1, dim),
    weight=weight,
    bias=bias,
    labels=labels.reshape(-1),
    valid=valid.reshape(-1),
    batch_shape=batch_shape,
    vocab_size=vocab_size,
    token_weights=None if token_weights is None else token_weights.reshape(-1),
    **classes,
  )
  return _manual_axes.common(rows)  # inside a caller's shard_map


def explicit_mesh(*arrays):
  """The mesh with Explicit axes that one of ``arrays`` is typed over, or None.

  On such a mesh (``jax.make_mesh``'s default axis type) the sharding is part
  of an array's type, and reshapes and gathers need operands sharded the way
  they allow.
  """
  for x in arrays:
    mesh = None if x is None else getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is not None and AxisType.Explicit in tuple(mesh.axis_types):
      return mesh
  return None


def spec_entry(x: jax.Array, dim: int):
  """The mesh axes that dimension ``dim`` of ``x`` is split over (None: none)."""
  spec = jax.typeof(x).sharding.spec
  return spec[dim] if dim < len(spec) else None


def _axes(entry) -> set[str]:
  if entry is None:
    return set()
  return {entry} if isinstance(entry, str) else set(entry)


def _as_rows_on(mesh, vocab_axis: int, hidden, weight, labels, *optional):
  """The arguments resharded on the Explicit ``mesh`` so that they flatten
  into rows: tokens split only as the leading axis is (a split sequence or D
  axis is gathered), the weight and bias only along V and over axes the rows
  do not use, the class weights whole (each row reads its label's).

  ``optional`` are ``(bias, where, token_weights, class_weights)``.
  """
  bias, where, token_weights, class_weights = optional
  rows = spec_entry(hidden, 0)
  vocab = spec_entry(weight, vocab_axis)
  if _axes(vocab) & _axes(rows):
    vocab = None  # a weight split like the rows (FSDP) is gathered

  def put(x, *spec):
    if x is None:
      return None
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))

  def tokens(x):
    return None if x is None else put(x, rows, *(None,) * (x.ndim - 1))

  weight_spec = [None, None]
  weight_spec[vocab_axis] = vocab
  return (
    tokens(hidden),
    put(weight, *weight_spec),
    tokens(labels),
    put(bias, vocab),
    tokens(where),
    tokens(token_weights),
    put(class_weights, None),
  )


def int32_labels(
  labels: jax.Array, vocab_size: int, ignore_index: int
) -> tuple[jax.Array, jax.Array]:
  """``(labels as int32, valid)``, each label keeping its meaning whatever
  its dtype.

  A value outside ``[0, V)`` stays outside (it becomes ``V``; its loss is
  NaN), and only ``ignore_index`` itself is ignored (not valid), where the
  dtype can hold it: a uint32 4294967196 does not wrap to -100, nor an
  int64 2**32 + 3 to class 3, and a uint32 ``ignore_index=2**32 - 1`` works.
  """
  info = jnp.iinfo(labels.dtype)
  if info.min <= ignore_index <= info.max:
    valid = labels != jnp.asarray(ignore_index, labels.dtype)
  else:
    valid = jnp.ones(labels.shape, bool)
  if labels.dtype == jnp.int32:
    return labels, valid
  in_range = labels >= jnp.asarray(0, labels.dtype)
  if vocab_size <= info.max:
    in_range = in_range & (labels < jnp.asarray(vocab_size, labels.dtype))
  # Values that int32 cannot hold are out of range, and replaced here.
  return jnp.where(in_range, labels.astype(jnp.int32), jnp.int32(vocab_size)), valid


def shift(x: jax.Array, fill, axis: int = -1) -> jax.Array:
  """``x[..., t + 1]`` at position ``t`` (along ``axis``); ``fill`` at the
  last position."""
  rest = lax.slice_in_dim(x, 1, None, axis=axis)
  last = jnp.full_like(lax.slice_in_dim(x, 0, 1, axis=axis), fill)
  return jnp.concatenate([rest, last], axis=axis)


def append_rows(
  x: jax.Array | None, count: int, fill=0, *, groups: int = 1
) -> jax.Array | None:
  """``x`` (``[N, ...]``, or None) with ``count`` rows of ``fill`` appended
  to each of its ``groups`` equal blocks of rows (the blocks a mesh's batch
  axis gives its devices, so that each device gets its own)."""
  if x is None:
    return None
  blocks = x.reshape(groups, x.shape[0] // groups, *x.shape[1:])
  pad = [(0, 0), (0, count)] + [(0, 0)] * (x.ndim - 1)
  blocks = jnp.pad(blocks, pad, constant_values=fill)
  return blocks.reshape(-1, *x.shape[1:])


def drop_appended(x: jax.Array, count: int, *, groups: int = 1) -> jax.Array:
  """``x`` without the rows ``append_rows`` appended (``[N, ...]`` again)."""
  blocks = x.reshape(groups, x.shape[0] // groups, *x.shape[1:])
  return blocks[:, : blocks.shape[1] - count].reshape(-1, *x.shape[1:])


def finite_label(bias: jax.Array | None) -> jax.Array | int:
  """A class whose score is finite in a row of zero hidden states: the
  largest bias's (a ``-inf`` bias bans a class), or 0 without a bias."""
  return 0 if bias is None else jnp.argmax(bias).astype(jnp.int32)


def with_rows_appended(rows: Rows, count: int, *, groups: int = 1) -> Rows:
  """``rows`` and ``count`` more at the end of each of ``groups`` equal
  blocks (``append_rows``): zero hidden states, a label of finite score
  (``finite_label``), valid.

  Valid, so that a block of rows holding them still runs whole (the fast
  path of blocks whose rows all count); the caller gives them zero weight in
  the loss and drops their per-row outputs, so no loss or gradient comes
  from them (``_plan.tma_row_padding`` says when to append). Their loss
  is finite, so zero weight makes it exactly nothing (``0 * inf`` is NaN).
  """
  append = lambda x, fill=0: append_rows(x, count, fill, groups=groups)
  return rows._replace(
    hidden=append(rows.hidden),
    labels=append(rows.labels, finite_label(rows.bias)),
    valid=append(rows.valid, True),
    token_weights=append(rows.token_weights),
    target_weight=append(rows.target_weight),
    mean_weight=append(rows.mean_weight),
    ids=append(rows.ids),
  )


def row_weights(rows: Rows, reduction: str, dtype) -> jax.Array:
  """Each row's weight in the loss: ``valid``, times the token weights; for a
  mean, over their sum (each times its label's class weight, with class
  weights: torch's weighted mean).

  A mean over no valid row (or over weights that sum to 0) is exactly 0, not
  NaN.
  """
  weights = rows.valid.astype(dtype)
  if rows.token_weights is not None:
    # Selected, not multiplied: a NaN weight at an excluded token stays out.
    weights = jnp.where(rows.valid, rows.token_weights.astype(dtype), 0.0)
  if reduction != "mean":
    return weights
  if rows.token_weights is None and rows.target_weight is None:
    return weights / jnp.maximum(jnp.sum(rows.valid), 1).astype(dtype)
  counted = weights
  if rows.target_weight is not None:
    counted = weights * rows.target_weight.astype(dtype)
  total = jnp.sum(counted)
  return jnp.where(total == 0, 0.0, weights / jnp.where(total == 0, 1, total))


def finalize(
  rows: Rows,
  loss: jax.Array,
  lse: jax.Array,
  correct: jax.Array,
  *,
  weights: jax.Array,
  options: LossOptions,
  return_aux: bool,
):
  """The public outputs from per-row ones (each ``[N]``, zero at excluded rows).

  ``weights`` are ``row_weights(rows, options.reduction, lse.dtype)``;
  ``loss`` may also be the scalar loss already reduced with them.
  """
  reduction = options.reduction
  out_dtype = at_least_float32(lse.dtype)

  def reduce(per_row):
    per_row = per_row.astype(out_dtype)
    if reduction != "none":
      return jnp.sum(per_row * weights)
    if rows.token_weights is not None:
      per_row = per_row * weights
    return per_row.reshape(rows.batch_shape)

  reduced = reduce(loss) if loss.ndim else loss.astype(out_dtype)
  if not return_aux:
    return reduced
  aux = LossAux(
    lse=lse.astype(out_dtype).reshape(rows.batch_shape),
    n_valid=jnp.sum(rows.valid, dtype=jnp.int32),
    z_loss=reduce(options.z_loss * jnp.square(lse)),
    n_correct=jnp.sum(correct, dtype=jnp.int32),
  )
  return reduced, aux
