"""The per-row cross-entropy math, written once.

Every backend (the XLA one, the Pallas kernels) computes the same quantities
from a chunk of float32 logits. Whole-row reductions (max, sum-exp, target
logit, mean logit, argmax) are the backend's business because they are where a
kernel loops over vocabulary blocks; everything else (the softcap, how the
reductions combine into a loss, the gradient with respect to the logits) lives
here as elementwise code on arrays of any block shape, and the kernels call
these same functions on their blocks.

For one token with logits ``z`` (``[V]``), label ``y`` and options
``eps = label_smoothing``, ``zl = z_loss``, ``c = logit_softcap``,
``a = logit_scale``::

  s      = c * tanh(a z / c)            (s = a z without a softcap)
  lse    = log(sum_j exp(s_j))
  loss   = (1 - eps) * (lse - s_y) + eps * (lse - mean_j s_j) + zl * lse**2

The first two terms are ``-(1 - eps) * log p_y - eps * mean_j log p_j`` with
``p = softmax(s)`` (the torch / optax label-smoothing definition), written via
``lse`` so a backend never forms ``log_softmax`` over the whole row: it needs
only the row's max/sum-exp, the target logit and, with smoothing, the mean
logit. The gradient with respect to ``s`` is::

  dloss/ds_j = p_j * (1 + 2 * zl * lse) - (1 - eps) * [j == y] - eps / V

and ``ds/dz = a sech(a z / c)**2`` (``scores_grad``).

With class weights ``w`` (torch's ``cross_entropy(weight=...)``), a row's
cross-entropy terms are weighted per class, ``m = mean_j w_j``::

  loss = (1 - eps) * w_y * (lse - s_y) + eps * m * (lse - wmean(s)) + zl * lse**2
  dloss/ds_j = p_j * ((1 - eps) * w_y + eps * m + 2 * zl * lse)
               - (1 - eps) * w_y * [j == y] - eps * w_j / V

with ``wmean(s) = sum_j w_j s_j / sum_j w_j``; ``w = 1`` is the formula above.

With ``entropy`` (``linear_log_probs``), each row also has its softmax's
entropy ``H = lse - E`` with ``E = sum_j p_j s_j`` (the scores' mean under
the softmax, ``RowStats.expected_score``), whose gradient is::

  dH/ds_j = -p_j * (s_j - E)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def at_least_float32(dtype) -> jnp.dtype:
  """float32, or float64 for float64: the dtype the math runs in.

  ``jnp.promote_types(dtype, jnp.float32)`` for floating dtypes, without
  reading JAX's promotion mode (``jax_numpy_dtype_promotion="strict"`` has no
  implicit path from bfloat16 to float32).
  """
  return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


@dataclasses.dataclass(frozen=True)
class CEOptions:
  """Static options of the per-row loss (hashable, so usable as jit statics).

  Attributes:
    label_smoothing: ``eps`` in ``[0, 1]``.
    z_loss: coefficient of ``lse**2``, ``>= 0``.
    logit_softcap: ``c > 0`` or ``None`` for no softcap.
    logit_scale: ``a > 0``: the logits are scaled before the softcap.
    entropy: also compute each row's entropy (``RowStats.expected_score``).
  """

  label_smoothing: float = 0.0
  z_loss: float = 0.0
  logit_softcap: float | None = None
  logit_scale: float = 1.0
  entropy: bool = False

  def __post_init__(self) -> None:
    eps, zl, cap = self.label_smoothing, self.z_loss, self.logit_softcap
    scale = self.logit_scale
    if not (math.isfinite(scale) and scale > 0.0):
      raise ValueError(f"logit_scale must be finite and > 0, got {scale!r}.")
    if not (math.isfinite(eps) and 0.0 <= eps <= 1.0):
      raise ValueError(f"label_smoothing must be in [0, 1], got {eps!r}.")
    if not (math.isfinite(zl) and zl >= 0.0):
      raise ValueError(f"z_loss must be finite and >= 0, got {zl!r}.")
    if cap is not None and not (math.isfinite(cap) and cap > 0.0):
      raise ValueError(f"logit_softcap must be None or finite and > 0, got {cap!r}.")


class RowStats(NamedTuple):
  """Whole-row reductions of one chunk, each ``[rows]``; a backend's output.

  ``lse = row_max + log_sum_exp``; the two are kept apart because the loss
  subtracts logits of the row's own magnitude from lse: ``row_max - target`` is
  exact where ``lse - target`` would lose the digits of ``log_sum_exp`` (logits
  of magnitude 1e4 in float32 have an ulp of 1e-3).

  Attributes:
    row_max: float32 max of the scores ``s`` (scaled, softcapped logits).
    log_sum_exp: float32 ``log(sum(exp(s - row_max)))``.
    target: float32 score at the label; any value where the label
      is outside ``[0, V)`` (``row_outputs`` replaces it with NaN).
    mean_logit: float32 mean of the scores over the vocabulary;
      only read when ``label_smoothing > 0``, so a backend may return zeros
      otherwise.
    argmax: int32 index of the first maximum of the logits.
    expected_score: float32 ``sum_j p_j s_j`` with ``p = softmax(s)``; None
      unless ``CEOptions.entropy``.
    mean_weight: with class weights, the sum of the columns' weights, which
      ``mean_logit`` is the weighted mean over (None: the mean is over the
      columns, each of weight 1).
  """

  row_max: jax.Array
  log_sum_exp: jax.Array
  target: jax.Array
  mean_logit: jax.Array
  argmax: jax.Array
  expected_score: jax.Array | None = None
  mean_weight: jax.Array | None = None

  @property
  def lse(self) -> jax.Array:
    return self.row_max + self.log_sum_exp


def upcast(x: jax.Array) -> jax.Array:
  """16-bit values (logits) in float32 (other dtypes as they are), rounded to
  their own dtype first: XLA may fold the convert into the matmul that forms
  them and read its float32 result unrounded, while a later pass reads the
  logits rounded; statistics and gradients would then see different logits
  (bfloat16 gradients 2.4x the naive head's error at N=87, V=1031 on XLA:CPU)."""
  dtype = at_least_float32(x.dtype)
  if dtype == x.dtype:
    return x
  info = jnp.finfo(x.dtype)
  return lax.reduce_precision(x.astype(dtype), info.nexp, info.nmant)


def max_shift(row_max: jax.Array) -> jax.Array:
  """What a row's scores are shifted by before ``exp``: its max, or 0 where
  every score is -inf (banned tokens: no mass, not ``-inf - -inf = NaN``)."""
  return jnp.where(row_max > -jnp.inf, row_max, 0.0)


def combine_stats(
  parts: RowStats,
  here: jax.Array,
  offset: jax.Array,
  width: jax.Array,
  vocab_size: int,
  *,
  reduce_max: Callable[[jax.Array], jax.Array],
  reduce_sum: Callable[[jax.Array], jax.Array],
  reduce_min: Callable[[jax.Array], jax.Array],
) -> RowStats:
  """The ``RowStats`` of whole rows from those of their column ranges.

  The parts are reductions of disjoint column ranges of the same rows
  (vocabulary blocks, or the shards of a vocab-parallel weight). ``reduce_*``
  reduce over the parts: over a stacked leading axis (``jnp.max(x, 0)``) or
  over a mesh axis (``lax.pmax(x, axis)``).

  Args:
    parts: each part's statistics, computed with labels relative to its first
      column (``argmax`` likewise).
    here: bool, per part and row: the label is in the part's range.
    offset: each part's first column.
    width: each part's number of columns (the mean logit's weight, unless
      the parts carry ``mean_weight``).
    vocab_size: ``V`` (an argmax sentinel above every column).
    reduce_max, reduce_sum, reduce_min: reductions over the parts.

  Returns:
    The combined ``RowStats``: one max/sum-exp merge, the target logit from
    the part that holds the label, the width-weighted mean, the first argmax,
    and the expected score weighted by each part's share of the softmax.
  """
  row_max = reduce_max(parts.row_max)
  # Each part's sum-exp, rescaled from its own max to the combined one (from
  # 0 while every part is -inf, banned tokens: no mass, not -inf - -inf).
  shift = max_shift(row_max)
  part_sum_exp = jnp.exp(parts.row_max - shift + parts.log_sum_exp)
  sum_exp = reduce_sum(part_sum_exp)
  first = jnp.where(parts.row_max == row_max, parts.argmax + offset, vocab_size)
  weight = width if parts.mean_weight is None else parts.mean_weight
  total = reduce_sum(weight)  # 0 with no class of any weight: a mean of 0
  mean_weight = None if parts.mean_weight is None else total
  expected = None
  if parts.expected_score is not None:
    # A part without probability mass (all its scores -inf) adds nothing,
    # though its own expected score is NaN.
    share = part_sum_exp / sum_exp
    expected = reduce_sum(jnp.where(share > 0, share * parts.expected_score, 0.0))
  return RowStats(
    row_max=row_max,
    log_sum_exp=jnp.log(sum_exp),
    target=reduce_sum(jnp.where(here, parts.target, 0.0)),
    # A part of weight 0 (its classes all weighted 0) adds nothing.
    mean_logit=reduce_sum(jnp.where(weight > 0, parts.mean_logit * weight, 0.0))
    / jnp.where(total > 0, total, 1.0),
    argmax=reduce_min(first),
    expected_score=expected,
    mean_weight=mean_weight,
  )


class ClassRows(NamedTuple):
  """Per-row class-weight factors, each float32 ``[rows]``.

  Attributes:
    target_weight: ``w_y``, the weight of each row's label.
    mean_weight: ``m``, the mean class weight (the same in every row).
  """

  target_weight: jax.Array
  mean_weight: jax.Array


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
  """``cap * tanh(logits / cap)`` (Gemma-2 style); identity when ``cap`` is None."""
  if cap is None:
    return logits
  return cap * jnp.tanh(logits / cap)


def scores(logits: jax.Array, options: CEOptions) -> jax.Array:
  """``s = softcap(logit_scale * logits)``: what the softmax sees."""
  if options.logit_scale != 1.0:
    logits = options.logit_scale * logits
  return softcap(logits, options.logit_softcap)


def scores_grad(logits: jax.Array, options: CEOptions) -> jax.Array | float:
  """``ds / dlogits``: ``logit_scale`` times the softcap's derivative."""
  scale, cap = options.logit_scale, options.logit_softcap
  if cap is None:
    return scale
  if scale == 1.0:
    return softcap_grad(logits, cap)
  return scale * softcap_grad(scale * logits, cap)


def label_in_range(labels: jax.Array, vocab_size: int) -> jax.Array:
  return (labels >= 0) & (labels < vocab_size)


def row_outputs(
  stats: RowStats,
  labels: jax.Array,
  valid: jax.Array,
  options: CEOptions,
  vocab_size: int,
  classes: ClassRows | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Combines a chunk's ``RowStats`` into per-row outputs.

  Args:
    stats: the backend's reductions, each ``[rows]``.
    labels: int32 ``[rows]``.
    valid: bool ``[rows]``; False rows give exactly zero in every output.
    options: the loss options.
    vocab_size: ``V``.
    classes: the rows' class-weight factors, or None (no class weights).

  Returns:
    ``(loss, lse, correct, entropy)``, each ``[rows]``: the float32 loss of
    each row (NaN where a valid row's label is outside ``[0, V)``: such a
    label is an error, and it must not be read as some valid class), its lse,
    whether the argmax equals the label, and the entropy of its softmax
    (zeros unless ``options.entropy``).
  """
  eps, zl = options.label_smoothing, options.z_loss
  lse = stats.lse
  target = jnp.where(label_in_range(labels, vocab_size), stats.target, jnp.nan)
  # (1-eps)*(lse - s_y) + eps*(lse - mean(s)), with lse = max + log_sum_exp and
  # the max subtracted first: differences of same-magnitude logits are exact.
  if classes is None:
    loss = (1.0 - eps) * (stats.row_max - target) + stats.log_sum_exp
    if eps:
      loss = loss + eps * (stats.row_max - stats.mean_logit)
  else:
    w_y, m = classes
    loss = (1.0 - eps) * w_y * (stats.row_max - target + stats.log_sum_exp)
    if eps:
      loss = loss + eps * m * (stats.row_max - stats.mean_logit + stats.log_sum_exp)
  if zl:
    loss = loss + zl * lse * lse
  entropy = zero = jnp.zeros_like(lse)
  if options.entropy:
    # lse - E with the max taken out of both: scores of a row's own magnitude.
    entropy = stats.log_sum_exp - (stats.expected_score - stats.row_max)
  return (
    jnp.where(valid, loss, zero),
    jnp.where(valid, lse, zero),
    valid & (stats.argmax == labels),
    jnp.where(valid, entropy, zero),
  )


class BackwardRows(NamedTuple):
  """Per-row inputs of ``dlogits_block``, each float32 ``[rows]``.

  ``dlogits = coef_softmax * p - coef_target * ((1 - eps) * onehot + eps / V)``
  (times ``scores_grad``), with ``p = exp(s - lse)``.

  Attributes:
    lse: the saved log-sum-exp; +inf at excluded rows, so that their
      probabilities are exactly 0 whatever their logits (0 * exp(large) would
      be NaN).
    coef_softmax: ``g_loss * (1 + 2 * zl * lse) + g_lse``; 0 at excluded rows.
      The lse output is differentiable, so its cotangent ``g_lse`` adds here.
    coef_target: ``g_loss`` (times ``w_y`` with class weights and no
      smoothing); 0 at excluded rows and NaN where a valid row's label is
      outside ``[0, V)``, so that row's gradient is NaN like its loss.
    coef_entropy: the entropy's cotangent ``g_H`` (0 at excluded rows), or
      None without ``CEOptions.entropy``.
    expected_score: ``E = lse - H`` (0 at excluded rows), or None likewise.
    target_weight: ``w_y`` with class weights and smoothing, else None.
  """

  lse: jax.Array
  coef_softmax: jax.Array
  coef_target: jax.Array
  coef_entropy: jax.Array | None = None
  expected_score: jax.Array | None = None
  target_weight: jax.Array | None = None


def backward_rows(
  g_loss: jax.Array,
  g_lse: jax.Array,
  lse: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  options: CEOptions,
  vocab_size: int,
  g_entropy: jax.Array | None = None,
  entropy: jax.Array | None = None,
  classes: ClassRows | None = None,
) -> BackwardRows:
  """Per-row coefficients of ``dlogits`` from the upstream cotangents.

  Args:
    g_loss: float32 ``[rows]`` cotangent of the per-row loss.
    g_lse: float32 ``[rows]`` cotangent of the per-row lse.
    lse: float32 ``[rows]`` saved log-sum-exp.
    labels: int32 ``[rows]``.
    valid: bool ``[rows]``.
    options: the loss options.
    vocab_size: ``V``.
    g_entropy: float32 ``[rows]`` cotangent of the per-row entropy (with
      ``options.entropy``).
    entropy: float32 ``[rows]`` saved entropy (likewise).
    classes: the rows' class-weight factors, or None.

  Returns:
    A ``BackwardRows``.
  """
  eps = options.label_smoothing
  mass = 1.0
  if classes is not None:  # (1 - eps) w_y + eps m, which is 1 without weights
    mass = (1.0 - eps) * classes.target_weight + eps * classes.mean_weight
  coef_softmax = g_loss * (mass + 2.0 * options.z_loss * lse) + g_lse
  coef_target = jnp.where(label_in_range(labels, vocab_size), g_loss, jnp.nan)
  target_weight = None if classes is None else classes.target_weight
  if target_weight is not None and not eps:
    # w_y scales the label's term alone: kernels reading no target_weight.
    coef_target, target_weight = coef_target * target_weight, None
  zero = jnp.zeros_like(lse)
  coef_entropy = expected = None
  if options.entropy:
    coef_entropy = jnp.where(valid, g_entropy, zero)
    expected = jnp.where(valid, lse - entropy, zero)
  return BackwardRows(
    lse=jnp.where(valid, lse, jnp.inf),
    coef_softmax=jnp.where(valid, coef_softmax, zero),
    coef_target=jnp.where(valid, coef_target, zero),
    coef_entropy=coef_entropy,
    expected_score=expected,
    target_weight=target_weight,
  )


def softcap_grad(logits: jax.Array, cap: float) -> jax.Array:
  """``d softcap / d logits = sech(logits / cap)**2``, without cancellation.

  ``1 - tanh(x)**2`` loses every digit once ``tanh(x)`` rounds near 1 (from
  ``|x| > 4`` in float32); ``4 e^{-2|x|} / (1 + e^{-2|x|})**2`` is the same
  function, accurate for every ``x`` and never overflows.
  """
  decay = jnp.exp(-2.0 * jnp.abs(logits / cap))
  return 4.0 * decay / jnp.square(1.0 + decay)


def per_row(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x [rows]`` repeated along a ``shape`` block's columns: an explicit
  broadcast (``x[:, None]``'s ``[rows, 1]`` step has no Mosaic GPU layout)."""
  return lax.broadcast_in_dim(x, shape, (0,))


def dlogits_block(
  logits: jax.Array,
  cols: jax.Array,
  labels: jax.Array,
  rows: BackwardRows,
  options: CEOptions,
  vocab_size: int,
  class_weights: jax.Array | None = None,
) -> jax.Array:
  """Gradient of the loss with respect to a block of raw logits, in float32.

  Args:
    logits: float32 ``[rows, block]`` raw (not scaled or softcapped) logits.
    cols: int32 ``[block]`` vocabulary index of each column of the block, or
      ``[rows, block]`` (each element's).
    labels: int32 ``[rows]``.
    rows: the block's rows of ``backward_rows``.
    options: the loss options.
    vocab_size: ``V``.
    class_weights: float32 ``[block]``, the block's class weights (with
      ``rows.target_weight``), or None.

  Returns:
    float32 ``[rows, block]``.
  """
  eps, shape = options.label_smoothing, logits.shape
  per_col = functools.partial(
    lax.broadcast_in_dim, shape=shape, broadcast_dimensions=(1,)
  )
  capped = scores(logits, options)
  probs = jnp.exp(capped - per_row(rows.lse, shape))  # [rows, block]
  onehot = (per_col(cols) if cols.ndim == 1 else cols) == per_row(labels, shape)
  if rows.target_weight is None:
    target_weight = jnp.where(onehot, 1.0 - eps, 0.0)
    if eps:
      target_weight = target_weight + eps / vocab_size
  else:
    label_weight = (1.0 - eps) * per_row(rows.target_weight, shape)
    target_weight = jnp.where(onehot, label_weight, 0.0)
    if eps:
      target_weight = target_weight + (eps / vocab_size) * per_col(class_weights)
  grad = (
    per_row(rows.coef_softmax, shape) * probs
    - per_row(rows.coef_target, shape) * target_weight
  )
  if options.entropy:
    spread = capped - per_row(rows.expected_score, shape)
    # Where p is 0 (a score of -inf) the term is 0, not 0 * -inf.
    spread = jnp.where(probs > 0, probs * spread, 0.0)
    grad = grad - per_row(rows.coef_entropy, shape) * spread
  if options.logit_softcap is not None or options.logit_scale != 1.0:
    grad = grad * scores_grad(logits, options)
  return grad
