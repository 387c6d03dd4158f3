"""The tests' float64 oracle, written from the documented definitions.

It imports nothing from ``mst_jax``: a bug in the library's argument handling
(masks, shift, weights, reductions) cannot hide by being in the oracle too.
Each function forms the whole logits in float64 with ``jax.numpy``, keeps the
arrays' batch shape, and is differentiable by ``jax.grad`` / ``jax.jvp`` /
``jax.vjp`` to any order. Call them inside ``with jax.enable_x64(True):``;
arguments of any float dtype are converted to float64 here. A gradient comes
back in the dtype of the array it is taken with respect to, so pass float64
arrays for float64 gradients.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
  "cross_entropy",
  "cross_entropy_of_logits",
  "distillation",
  "distillation_of_logits",
  "log_probs",
  "log_probs_of_logits",
]

_REDUCTIONS = ("mean", "sum", "none")
_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _require_x64() -> None:
  if not jax.config.jax_enable_x64:
    raise AssertionError(
      "tests/oracle.py computes in float64: call it inside"
      " `with jax.enable_x64(True):`."
    )


def _f64(x):
  return None if x is None else jnp.asarray(x).astype(jnp.float64)


def _check(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


def _shift(x, fill):
  """``x[..., t + 1]`` at position ``t``; ``fill`` at the last position."""
  return jnp.concatenate([x[..., 1:], jnp.full_like(x[..., :1], fill)], axis=-1)


def _tokens(labels, batch_shape, where, ignore_index, shift, token_weights=None):
  """``(labels as int64, valid, token_weights)`` at the positions they score.

  A token counts when its label is not ``ignore_index`` and ``where`` is True
  there; with ``shift`` position ``t`` takes label position ``t + 1``'s label,
  mask and weight, and the last position of each sequence counts for nothing.
  """
  valid = jnp.ones(batch_shape, bool)
  if labels is not None:
    labels = jnp.asarray(labels)
    if labels.shape != batch_shape:
      raise ValueError(f"labels {labels.shape} != hidden's leading {batch_shape}")
    info = np.iinfo(labels.dtype)
    if info.min <= ignore_index <= info.max:  # a dtype that can hold it
      valid = labels != jnp.asarray(ignore_index, labels.dtype)
    labels = labels.astype(jnp.int64)
  if where is not None:
    valid = valid & jnp.asarray(where, bool)
  if token_weights is not None:
    token_weights = lax.stop_gradient(_f64(token_weights))
  if shift:
    valid = _shift(valid, False)
    labels = None if labels is None else _shift(labels, 0)
    token_weights = None if token_weights is None else _shift(token_weights, 0.0)
  if token_weights is not None:  # selected: a NaN weight at an excluded token stays out
    token_weights = jnp.where(valid, token_weights, 0.0)
  return labels, valid, token_weights


def _logits(hidden, weight, bias, valid, weight_layout):
  """``hidden @ W + bias``, ``[..., V]`` float64 (``W`` the ``[D, V]`` view).

  Excluded tokens' hidden states are replaced by zeros first: a NaN there
  must change nothing, gradients included.
  """
  hidden, weight, bias = _f64(hidden), _f64(weight), _f64(bias)
  w_dv = weight if weight_layout == "dv" else weight.T
  hidden = jnp.where(valid[..., None], hidden, 0.0)
  logits = jnp.matmul(hidden, w_dv, precision=lax.Precision.HIGHEST)
  return logits if bias is None else logits + bias


def _head(logits, logit_scale, logit_softcap):
  """The scores ``softcap(logit_scale * logits)``, float64."""
  scores = _f64(logits)
  if logit_scale is not None:
    scores = logit_scale * scores
  if logit_softcap is not None:
    scores = logit_softcap * jnp.tanh(scores / logit_softcap)
  return scores


def _label_scores(scores, labels, valid):
  """``(scores with NaN rows, s[y], in_range)``: a valid token whose label is
  outside ``[0, V)`` gets NaN scores, so its loss and gradients are NaN."""
  vocab = scores.shape[-1]
  in_range = (labels >= 0) & (labels < vocab)
  scores = scores + jnp.where(valid & ~in_range, jnp.nan, 0.0)[..., None]
  safe = jnp.where(in_range, labels, 0)
  target = jnp.take_along_axis(scores, safe[..., None], axis=-1)[..., 0]
  return scores, target, in_range


def _reduce(per_token, valid, token_weights, denominator_weights, reduction):
  """Per-token values (excluded ones selected away) reduced as documented.

  ``"mean"`` divides by the sum of ``denominator_weights`` over valid tokens
  (0.0 when that is 0), ``"sum"`` sums, ``"none"`` keeps the shape.
  """
  if token_weights is not None:
    per_token = per_token * token_weights
  per_token = jnp.where(valid, per_token, 0.0)
  if reduction == "none":
    return per_token
  total = jnp.sum(per_token)
  if reduction == "sum":
    return total
  count = jnp.sum(jnp.where(valid, denominator_weights, 0.0))
  return jnp.where(count == 0, 0.0, total / jnp.where(count == 0, 1.0, count))


def cross_entropy(
  hidden,
  weight,
  labels,
  bias=None,
  *,
  where=None,
  token_weights=None,
  class_weights=None,
  ignore_index=-100,
  reduction="mean",
  label_smoothing=0.0,
  z_loss=0.0,
  logit_softcap=None,
  logit_scale=None,
  shift=False,
  weight_layout="vd",
):
  """``mst_jax.linear_cross_entropy``'s value from its definition, in float64.

  Per token, with ``s = softcap(logit_scale * (hidden @ W + bias))`` (``W``
  the ``[D, V]`` view of ``weight``), ``lse = logsumexp(s)``, ``eps`` the
  label smoothing and ``w`` the class weights (all ones without)::

    loss = (1 - eps) w[y] (lse - s[y]) + (eps / V) sum_c w[c] (lse - s[c])
           + z_loss lse**2

  (a class of weight 0 adds nothing, even at ``s[c] = -inf``; the smoothing
  term only with ``eps > 0``). A token counts when its label is not
  ``ignore_index`` and ``where`` holds (with ``shift``, position ``t`` takes
  label position ``t + 1``'s label, ``where`` and token weight; the last
  position counts for nothing). Counted tokens' losses are multiplied by
  ``token_weights``; ``"sum"`` adds them, ``"mean"`` divides that sum by
  ``sum(token_weight * w[y])`` over counted tokens (0.0 when it is 0),
  ``"none"`` returns them (0 at excluded tokens). A counted token's label
  outside ``[0, V)`` makes its loss and gradients NaN. ``token_weights`` and
  ``class_weights`` are data (not differentiated).

  Returns:
    float64: a scalar, or the shape of ``labels`` for ``"none"``.
  """
  _require_x64()
  _check("weight_layout", weight_layout, ("vd", "dv"))
  batch_shape = jnp.shape(hidden)[:-1]
  _, valid, _ = _tokens(labels, batch_shape, where, ignore_index, shift)
  return cross_entropy_of_logits(
    _logits(hidden, weight, bias, valid, weight_layout),
    labels,
    where=where,
    token_weights=token_weights,
    class_weights=class_weights,
    ignore_index=ignore_index,
    reduction=reduction,
    label_smoothing=label_smoothing,
    z_loss=z_loss,
    logit_softcap=logit_softcap,
    logit_scale=logit_scale,
    shift=shift,
  )


def cross_entropy_of_logits(
  logits,
  labels,
  *,
  where=None,
  token_weights=None,
  class_weights=None,
  ignore_index=-100,
  reduction="mean",
  label_smoothing=0.0,
  z_loss=0.0,
  logit_softcap=None,
  logit_scale=None,
  shift=False,
):
  """``cross_entropy`` of given raw logits ``[..., V]`` (``hidden @ W + bias``).

  The logits may be of any float dtype (they are converted to float64), so a
  head that rounds its logits can be differentiated through this loss, the
  cotangent rounded back to their dtype as autodiff does.
  """
  _require_x64()
  _check("reduction", reduction, _REDUCTIONS)
  batch_shape = jnp.shape(logits)[:-1]
  labels, valid, token_weights = _tokens(
    labels, batch_shape, where, ignore_index, shift, token_weights
  )
  scores = _head(
    jnp.where(valid[..., None], _f64(logits), 0.0), logit_scale, logit_softcap
  )
  vocab = scores.shape[-1]
  scores, target, in_range = _label_scores(scores, labels, valid)
  lse = jax.nn.logsumexp(scores, axis=-1)
  eps = label_smoothing
  if class_weights is None:
    w_label = jnp.ones(batch_shape, jnp.float64)
    loss = (1.0 - eps) * (lse - target)
    if eps:
      loss = loss + eps * (lse - jnp.mean(scores, axis=-1))
  else:
    w = lax.stop_gradient(_f64(class_weights))
    w_label = jnp.where(in_range, w[jnp.where(in_range, labels, 0)], 0.0)
    loss = (1.0 - eps) * w_label * (lse - target)
    if eps:
      terms = jnp.where(w > 0, w * (lse[..., None] - scores), 0.0)
      loss = loss + eps / vocab * jnp.sum(terms, axis=-1)
  loss = loss + z_loss * jnp.square(lse)
  denominator = w_label if token_weights is None else w_label * token_weights
  return _reduce(loss, valid, token_weights, denominator, reduction)


def log_probs(
  hidden,
  weight,
  labels,
  bias=None,
  *,
  ignore_index=-100,
  where=None,
  logit_scale=None,
  logit_softcap=None,
  shift=False,
  weight_layout="vd",
  return_entropy=False,
):
  """``mst_jax.linear_log_probs`` from its definition, in float64.

  Per token, with ``s`` the scores of ``cross_entropy``::

    log_prob = s[y] - logsumexp(s)
    entropy  = -sum_c p_c log p_c,   p = softmax(s)   (p_c = 0 adds 0)

  Both are 0.0 at excluded tokens (masks and ``shift`` as in
  ``cross_entropy``); a counted token's label outside ``[0, V)`` makes its
  log-probability NaN (its entropy does not read the label).

  Returns:
    float64 ``log_probs`` with the shape of ``labels``, or
    ``(log_probs, entropy)`` with ``return_entropy``.
  """
  _require_x64()
  _check("weight_layout", weight_layout, ("vd", "dv"))
  batch_shape = jnp.shape(hidden)[:-1]
  _, valid, _ = _tokens(labels, batch_shape, where, ignore_index, shift)
  return log_probs_of_logits(
    _logits(hidden, weight, bias, valid, weight_layout),
    labels,
    ignore_index=ignore_index,
    where=where,
    logit_scale=logit_scale,
    logit_softcap=logit_softcap,
    shift=shift,
    return_entropy=return_entropy,
  )


def log_probs_of_logits(
  logits,
  labels,
  *,
  ignore_index=-100,
  where=None,
  logit_scale=None,
  logit_softcap=None,
  shift=False,
  return_entropy=False,
):
  """``log_probs`` of given raw logits ``[..., V]``, of any float dtype (see
  ``cross_entropy_of_logits``)."""
  _require_x64()
  batch_shape = jnp.shape(logits)[:-1]
  labels, valid, _ = _tokens(labels, batch_shape, where, ignore_index, shift)
  logits = jnp.where(valid[..., None], _f64(logits), 0.0)
  clean = _head(logits, logit_scale, logit_softcap)
  scores, target, _ = _label_scores(clean, labels, valid)
  out = jnp.where(valid, target - jax.nn.logsumexp(scores, axis=-1), 0.0)
  if not return_entropy:
    return out
  log_p = jax.nn.log_softmax(clean, axis=-1)
  p = jnp.exp(log_p)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, log_p, 0.0), 0.0), -1)
  return out, jnp.where(valid, entropy, 0.0)


def _kl(log_a, log_b):
  """``sum_j a_j (log a_j - log b_j)``; a class with ``a_j = 0`` adds 0 (the
  inner ``where`` keeps its gradients finite)."""
  present = jnp.exp(log_a) > 0
  ratio = jnp.where(present, log_a, 0.0) - jnp.where(present, log_b, 0.0)
  return jnp.sum(jnp.where(present, jnp.exp(log_a) * ratio, 0.0), axis=-1)


def distillation(
  student_hidden,
  student_weight,
  teacher_hidden,
  teacher_weight,
  labels=None,
  *,
  student_bias=None,
  teacher_bias=None,
  divergence="forward_kl",
  beta=0.5,
  temperature=1.0,
  hard_label_weight=0.0,
  ignore_index=-100,
  where=None,
  reduction="mean",
  shift=False,
  weight_layout="vd",
  logit_softcap=None,
  logit_scale=None,
):
  """``mst_jax.linear_distillation_loss`` from its definition, in float64.

  Per token, with each head's scores ``s`` as in ``cross_entropy``,
  ``P = softmax(s_teacher / T)`` and ``Q = softmax(s_student / T)``::

    "forward_kl":  KL(P || Q) = sum_j P_j (log P_j - log Q_j)
    "reverse_kl":  KL(Q || P)
    "jsd":         beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q

    loss = divergence + hard_label_weight * (logsumexp(s_student) - s_student[y])

  (no ``T**2`` factor; the hard-label term at temperature 1; a class of
  probability 0 adds 0). Tokens count as in ``cross_entropy`` (without
  ``labels`` every token does, but for ``where`` and ``shift``); ``"mean"``
  divides by the number of counted tokens (0.0 when none). The teacher is
  data: it gets no gradient.

  Returns:
    float64: a scalar, or the shape of ``labels`` for ``"none"``.
  """
  _require_x64()
  _check("weight_layout", weight_layout, ("vd", "dv"))
  batch_shape = jnp.shape(student_hidden)[:-1]
  _, valid, _ = _tokens(labels, batch_shape, where, ignore_index, shift)
  student = _logits(student_hidden, student_weight, student_bias, valid, weight_layout)
  teacher_head = (_f64(teacher_hidden), _f64(teacher_weight), _f64(teacher_bias))
  teacher = _logits(*lax.stop_gradient(teacher_head), valid, weight_layout)
  return distillation_of_logits(
    student,
    teacher,
    labels,
    divergence=divergence,
    beta=beta,
    temperature=temperature,
    hard_label_weight=hard_label_weight,
    ignore_index=ignore_index,
    where=where,
    reduction=reduction,
    shift=shift,
    logit_softcap=logit_softcap,
    logit_scale=logit_scale,
  )


def distillation_of_logits(
  student_logits,
  teacher_logits,
  labels=None,
  *,
  divergence="forward_kl",
  beta=0.5,
  temperature=1.0,
  hard_label_weight=0.0,
  ignore_index=-100,
  where=None,
  reduction="mean",
  shift=False,
  logit_softcap=None,
  logit_scale=None,
):
  """``distillation`` of given raw logits ``[..., V]`` of both heads, of any
  float dtype (see ``cross_entropy_of_logits``); the teacher's are data."""
  _require_x64()
  _check("reduction", reduction, _REDUCTIONS)
  _check("divergence", divergence, _DIVERGENCES)
  if hard_label_weight and labels is None:
    raise ValueError("hard_label_weight > 0 needs labels.")
  batch_shape = jnp.shape(student_logits)[:-1]
  labels, valid, _ = _tokens(labels, batch_shape, where, ignore_index, shift)
  head = dict(logit_scale=logit_scale, logit_softcap=logit_softcap)
  rows = valid[..., None]
  student = _head(jnp.where(rows, _f64(student_logits), 0.0), **head)
  teacher = lax.stop_gradient(_f64(teacher_logits))
  teacher = _head(jnp.where(rows, teacher, 0.0), **head)
  log_q = jax.nn.log_softmax(student / temperature, axis=-1)
  log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
  if divergence == "forward_kl":
    loss = _kl(log_p, log_q)
  elif divergence == "reverse_kl":
    loss = _kl(log_q, log_p)
  else:
    # A class banned in both heads has log M = -inf; the inner where keeps
    # logaddexp's gradient there finite.
    both = (log_p == -jnp.inf) & (log_q == -jnp.inf)
    log_m = jnp.logaddexp(
      math.log(beta) + jnp.where(both, 0.0, log_p),
      math.log1p(-beta) + jnp.where(both, 0.0, log_q),
    )
    log_m = jnp.where(both, -jnp.inf, log_m)
    loss = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
  if hard_label_weight:
    scores, target, _ = _label_scores(student, labels, valid)
    loss = loss + hard_label_weight * (jax.nn.logsumexp(scores, axis=-1) - target)
  ones = jnp.ones(batch_shape, jnp.float64)
  return _reduce(loss, valid, None, ones, reduction)


# ---- Each public function as one compiled program. ----


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def arrays_and_static(kwargs: dict) -> tuple[dict, tuple]:
  """``kwargs`` split into arrays (a compiled program's arguments, as jax
  arrays of this x64 state: a compiled program's fast path would take a
  float64 numpy array's buffer as float32) and the rest, sorted (hashable:
  the program's key)."""
  arrays = {k: jnp.asarray(v) for k, v in kwargs.items() if _is_array(v)}
  return arrays, tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))


@functools.cache
def _program(fn, positions, static):
  """``fn`` jitted with ``static`` (sorted ``(name, value)`` pairs, and the
  non-array positional arguments at ``positions``) fixed."""
  fixed = dict(positions)

  def run(arrays, kwargs):
    args = [fixed[i] if i in fixed else arrays[i] for i in range(len(arrays))]
    return fn(*args, **dict(static), **kwargs)

  return jax.jit(run)


def _compiled(fn):
  """``fn`` as one compiled program per static arguments (its operations one
  by one would compile one small program each for every new shape: about a
  second of a test's time). Arrays (tracers included) are the program's
  arguments, every other value is static; unhashable ones run ``fn`` as is."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    positions = tuple((i, a) for i, a in enumerate(args) if not _is_array(a))
    arrays = [jnp.asarray(a) if _is_array(a) else None for a in args]
    dynamic, static = arrays_and_static(kwargs)
    try:
      program = _program(fn, positions, static)
    except TypeError:  # an unhashable option
      return fn(*args, **kwargs)
    return program(arrays, dynamic)

  return wrapper


cross_entropy = _compiled(cross_entropy)
cross_entropy_of_logits = _compiled(cross_entropy_of_logits)
log_probs = _compiled(log_probs)
log_probs_of_logits = _compiled(log_probs_of_logits)
distillation = _compiled(distillation)
distillation_of_logits = _compiled(distillation_of_logits)
