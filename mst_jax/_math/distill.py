"""The per-row distillation math, written once: divergences and their gradients.

For one token with the student's raw logits ``z_s`` and the teacher's ``z_t``
(each ``[V]``), both heads' scores are formed as in the cross-entropy
(``_math.ce.scores``: ``s = c * tanh(a z / c)``, or ``a z`` without a softcap)
and divided by the temperature ``T``::

  log Q = log_softmax(s_s / T)        (the student)
  log P = log_softmax(s_t / T)        (the teacher)

  forward_kl:  KL(P || Q) = sum_j P_j (log P_j - log Q_j)
  reverse_kl:  KL(Q || P) = sum_j Q_j (log Q_j - log P_j)
  jsd:         beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q

  loss = divergence + h * (lse(s_s) - s_s[y])     (h = hard_label_weight)

The hard-label term is the cross-entropy of the student's scores at
temperature 1 (``_math.ce``'s formulas). A class of probability 0 (a score of
-inf, a banned token) adds 0 to a sum, not ``0 * -inf``; ``log M`` is
``logaddexp(log beta + log P, log(1 - beta) + log Q)``, finite wherever ``P``
or ``Q`` is not 0.

The gradient with respect to ``u = s_s / T`` (the teacher is a constant)::

  forward_kl:  Q_j - P_j
  reverse_kl:  Q_j (r_j - KL(Q || P)),          r = log Q - log P
  jsd:         (1 - beta) Q_j (d_j - KL(Q || M)), d = log Q - log M

(for the JSD, ``dJ/dQ_j = (1 - beta)(log Q_j - log M_j)`` through the
softmax). Then ``d/ds = (1 / T) d/du + h (softmax(s_s) - onehot(y))`` and
``d/dz = d/ds * ds/dz`` (``_math.ce.scores_grad``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mst_jax._math import ce as ce_math
from mst_jax._math.ce import CEOptions, at_least_float32, per_row

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclasses.dataclass(frozen=True)
class DistillOptions:
  """Static options of the per-row distillation loss (hashable).

  Attributes:
    divergence: one of ``DIVERGENCES``.
    beta: the JSD's mixture weight, ``0 < beta < 1``; the other divergences
      take only the default 0.5 (another value raises: it would be ignored).
    temperature: ``T > 0``, finite.
    hard_label_weight: ``h >= 0``, finite.
    scores: the logit scale and softcap, applied to both heads.
  """

  divergence: str = "forward_kl"
  beta: float = 0.5
  temperature: float = 1.0
  hard_label_weight: float = 0.0
  scores: CEOptions = CEOptions()

  def __post_init__(self) -> None:
    if self.divergence not in DIVERGENCES:
      raise ValueError(
        f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}."
      )
    beta, temperature, weight = self.beta, self.temperature, self.hard_label_weight
    if self.divergence == "jsd" and not (math.isfinite(beta) and 0.0 < beta < 1.0):
      raise ValueError(f"beta must be in (0, 1) for divergence='jsd', got {beta!r}.")
    if self.divergence != "jsd" and beta != 0.5:
      raise ValueError(
        f"beta={beta!r} weighs the JSD's mixture; divergence={self.divergence!r}"
        " takes none (beta=0.5, the default). Use divergence='jsd'."
      )
    if not (math.isfinite(temperature) and temperature > 0.0):
      raise ValueError(f"temperature must be finite and > 0, got {temperature!r}.")
    if not (math.isfinite(weight) and weight >= 0.0):
      raise ValueError(f"hard_label_weight must be finite and >= 0, got {weight!r}.")
    if self.scores.label_smoothing or self.scores.z_loss or self.scores.entropy:
      raise ValueError("scores holds only the logit scale and softcap.")


class DistillStats(NamedTuple):
  """Per-row sums over the columns seen so far, each ``[rows]``.

  Blocks of columns merge with ``combine`` (an online max / sum-exp, as the
  cross-entropy's statistics). With ``u = s_s / T`` and ``v = s_t / T`` (the
  tempered scores of ``tempered``):

  Attributes:
    max_q: ``max_j u_j``.
    sum_q: ``sum_j exp(u_j - max_q)``.
    max_p: ``max_j v_j``.
    sum_p: ``sum_j exp(v_j - max_p)``.
    cross: ``"forward_kl"``: ``sum_j exp(v_j - max_p) (v_j - u_j)``;
      ``"reverse_kl"``: ``sum_j exp(u_j - max_q) (u_j - v_j)``; ``"jsd"``: 0
      (its sums need both lse first: ``jsd_sums``). A class of probability 0
      adds 0.
    max_s, sum_s: the same as ``max_q, sum_q`` for the untempered student
      scores, for the hard-label term at ``T != 1``; else None.
  """

  max_q: jax.Array
  sum_q: jax.Array
  max_p: jax.Array
  sum_p: jax.Array
  cross: jax.Array
  max_s: jax.Array | None = None
  sum_s: jax.Array | None = None


class DistillRows(NamedTuple):
  """Per-row inputs of ``dlogits_block``, each ``[rows]`` (from ``finish``).

  ``log Q = u - shift_q - log_sum_q`` (likewise ``log P``): the max and
  the log-sum-exp apart, as in ``_math.ce.RowStats``, so that scores of large
  magnitude (a low temperature) lose no digits to the rounding of their sum.

  Attributes:
    shift_q, log_sum_q: the tempered student's row max (0 where all scores
      are -inf; +inf at excluded rows, whose probabilities are then exactly
      0) and ``log sum_j exp(u_j - shift_q)``.
    shift_p, log_sum_p: the same for the teacher.
    kl: ``KL(Q || P)`` (``"reverse_kl"``), ``KL(Q || M)`` (``"jsd"``) or 0.
    coef: ``g_loss / T``; 0 at excluded rows.
    valid: bool; excluded rows get exactly 0 whatever their logits.
    hard: the hard-label term's ``_math.ce.BackwardRows`` (on the untempered
      scores), or None without that term.
  """

  shift_q: jax.Array
  log_sum_q: jax.Array
  shift_p: jax.Array
  log_sum_p: jax.Array
  kl: jax.Array
  coef: jax.Array
  valid: jax.Array
  hard: ce_math.BackwardRows | None = None


_PLAIN = CEOptions()  # the hard-label term sees scores already scaled and capped


def tempered(
  student_logits: jax.Array, teacher_logits: jax.Array, options: DistillOptions
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(s_s, u, v)`` of raw float logits: the student's scores, and both heads'
  scores divided by the temperature."""
  scores = ce_math.scores(student_logits, options.scores)
  teacher = ce_math.scores(teacher_logits, options.scores)
  if options.temperature == 1.0:
    return scores, scores, teacher
  return scores, scores / options.temperature, teacher / options.temperature


def _own_stats(options: DistillOptions) -> bool:
  """Whether the hard-label term needs sums of the untempered scores."""
  return bool(options.hard_label_weight) and options.temperature != 1.0


def _max_and_exp(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  row_max = jnp.max(x, axis=-1)
  return row_max, jnp.exp(x - per_row(ce_math.max_shift(row_max), x.shape))


def _weighted_sum(weights: jax.Array, values: jax.Array) -> jax.Array:
  """``sum_j w_j x_j`` over the last axis; a weight of 0 adds 0 (not 0 * inf)."""
  return jnp.sum(jnp.where(weights > 0, weights * values, 0.0), axis=-1)


def _logaddexp(a: jax.Array, b: jax.Array) -> jax.Array:
  """``log(exp(a) + exp(b))``; -inf where both are."""
  shift = ce_math.max_shift(jnp.maximum(a, b))
  return shift + jnp.log(jnp.exp(a - shift) + jnp.exp(b - shift))


def block_stats(
  scores: jax.Array, u: jax.Array, v: jax.Array, options: DistillOptions
) -> DistillStats:
  """``DistillStats`` of a block of columns: ``[rows, block]`` arrays from
  ``tempered``, with columns outside the vocabulary at -inf in all three."""
  max_q, exp_q = _max_and_exp(u)
  max_p, exp_p = _max_and_exp(v)
  if options.divergence == "forward_kl":
    cross = _weighted_sum(exp_p, v - u)
  elif options.divergence == "reverse_kl":
    cross = _weighted_sum(exp_q, u - v)
  else:
    cross = jnp.zeros_like(max_q)
  max_s = sum_s = None
  if _own_stats(options):
    max_s, exp_s = _max_and_exp(scores)
    sum_s = jnp.sum(exp_s, axis=-1)
  sum_q, sum_p = jnp.sum(exp_q, axis=-1), jnp.sum(exp_p, axis=-1)
  return DistillStats(max_q, sum_q, max_p, sum_p, cross, max_s, sum_s)


def empty_stats(shape, dtype, options: DistillOptions) -> DistillStats:
  """The ``DistillStats`` of no columns (``combine``'s identity)."""
  low, zero = jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype)
  own = (low, zero) if _own_stats(options) else (None, None)
  return DistillStats(low, zero, low, zero, zero, *own)


def _rescaled(max_a, max_b, *pairs):
  """The larger max, and each ``(a, b)`` pair of sums rescaled to it and added."""
  new_max = jnp.maximum(max_a, max_b)
  shift = ce_math.max_shift(new_max)
  scale_a, scale_b = jnp.exp(max_a - shift), jnp.exp(max_b - shift)
  return new_max, *(a * scale_a + b * scale_b for a, b in pairs)


def combine(a: DistillStats, b: DistillStats, options: DistillOptions) -> DistillStats:
  """The ``DistillStats`` of two disjoint sets of columns together."""
  # cross is weighted by the teacher's exp for the forward KL, else the student's.
  cross = [(a.cross, b.cross)]
  forward = options.divergence == "forward_kl"
  q_sums = [(a.sum_q, b.sum_q)] + ([] if forward else cross)
  p_sums = [(a.sum_p, b.sum_p)] + (cross if forward else [])
  max_q, sum_q, *cross_q = _rescaled(a.max_q, b.max_q, *q_sums)
  max_p, sum_p, *cross_p = _rescaled(a.max_p, b.max_p, *p_sums)
  own = (None, None)
  if a.max_s is not None:
    own = _rescaled(a.max_s, b.max_s, (a.sum_s, b.sum_s))
  return DistillStats(max_q, sum_q, max_p, sum_p, *cross_q, *cross_p, *own)


def log_norms(stats: DistillStats) -> tuple[jax.Array, ...]:
  """``(shift_q, log_sum_q, shift_p, log_sum_p)``: ``log Q = u - shift_q -
  log_sum_q`` and ``log P = v - shift_p - log_sum_p`` (see ``DistillRows``)."""
  return (
    ce_math.max_shift(stats.max_q),
    jnp.log(stats.sum_q),
    ce_math.max_shift(stats.max_p),
    jnp.log(stats.sum_p),
  )


def _log_probs(x: jax.Array, shift: jax.Array, log_sum: jax.Array) -> jax.Array:
  return (x - per_row(shift, x.shape)) - per_row(log_sum, x.shape)


def jsd_sums(
  u: jax.Array, v: jax.Array, norms: tuple[jax.Array, ...], beta: float
) -> tuple[jax.Array, jax.Array]:
  """``(KL(P || M), KL(Q || M))`` over a block of columns (block sums add up):
  ``[rows, block]`` tempered scores and ``log_norms``'s ``[rows]``."""
  log_q, log_p = _log_probs(u, *norms[:2]), _log_probs(v, *norms[2:])
  log_m = _logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
  kl_p = _weighted_sum(jnp.exp(log_p), log_p - log_m)
  return kl_p, _weighted_sum(jnp.exp(log_q), log_q - log_m)


def finish(
  stats: DistillStats,
  sums: tuple[jax.Array, jax.Array] | None,
  target: jax.Array | None,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array | None,
  options: DistillOptions,
  vocab_size: int,
) -> tuple[jax.Array, DistillRows | None]:
  """Per-row loss ``[rows]`` and, with ``g_loss``, the ``DistillRows`` of its
  gradient.

  Args:
    stats: the whole rows' ``DistillStats``.
    sums: ``jsd_sums`` over the whole rows (``"jsd"``), else None.
    target: the untempered student score at each label (any value where the
      label is outside ``[0, V)``), with a hard-label term; else None.
    labels: int32 ``[rows]``.
    valid: bool ``[rows]``; excluded rows give exactly 0.
    g_loss: float ``[rows]``, each row's cotangent, or None.
    options: the loss options.
    vocab_size: ``V``.
  """
  norms = log_norms(stats)
  log_ratio = stats.max_q - stats.max_p + jnp.log(stats.sum_q / stats.sum_p)
  kl = jnp.zeros_like(log_ratio)
  if options.divergence == "forward_kl":  # sum P (v - u) - lse_p + lse_q
    loss = stats.cross / stats.sum_p + log_ratio
  elif options.divergence == "reverse_kl":
    loss = kl = stats.cross / stats.sum_q - log_ratio
  else:
    kl_p, kl = sums
    loss = options.beta * kl_p + (1.0 - options.beta) * kl
  # A divergence is >= 0; its sums can round below 0 where P ~ Q.
  loss = jnp.maximum(loss, 0.0)
  weight, hard = options.hard_label_weight, None
  if weight:
    own = stats.max_s is not None
    ce_stats = ce_math.RowStats(
      row_max=stats.max_s if own else stats.max_q,
      log_sum_exp=jnp.log(stats.sum_s if own else stats.sum_q),
      target=target,
      mean_logit=jnp.zeros_like(log_ratio),
      argmax=jnp.zeros_like(labels),
    )
    hard_loss, hard_lse, _, _ = ce_math.row_outputs(
      ce_stats, labels, valid, _PLAIN, vocab_size
    )
    loss = loss + weight * hard_loss
  loss = jnp.where(valid, loss, jnp.zeros_like(loss))
  if g_loss is None:
    return loss, None
  coef = jnp.where(valid, g_loss.astype(log_ratio.dtype), 0.0)
  if weight:
    zeros = jnp.zeros_like(coef)
    hard = ce_math.backward_rows(
      weight * coef, zeros, hard_lse, labels, valid, _PLAIN, vocab_size
    )
  far = jnp.full_like(log_ratio, jnp.inf)
  shift_q, log_sum_q, shift_p, log_sum_p = norms
  return loss, DistillRows(
    shift_q=jnp.where(valid, shift_q, far),
    log_sum_q=log_sum_q,
    shift_p=jnp.where(valid, shift_p, far),
    log_sum_p=log_sum_p,
    kl=jnp.where(valid, kl, 0.0),
    coef=coef / options.temperature,
    valid=valid,
    hard=hard,
  )


def dlogits_block(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  cols: jax.Array,
  labels: jax.Array,
  rows: DistillRows,
  options: DistillOptions,
  vocab_size: int,
) -> jax.Array:
  """The gradient with respect to a block of the student's raw logits.

  Args:
    student_logits, teacher_logits: float ``[rows, block]`` raw logits.
    cols: int32 ``[block]``, each column's vocabulary index.
    labels: int32 ``[rows]``.
    rows: the block's rows of ``finish``'s ``DistillRows``.
    options: the loss options.
    vocab_size: ``V``.

  Returns:
    ``[rows, block]`` in the logits' dtype.
  """
  scores, u, v = tempered(student_logits, teacher_logits, options)
  log_q = _log_probs(u, rows.shift_q, rows.log_sum_q)
  log_p = _log_probs(v, rows.shift_p, rows.log_sum_p)
  q = jnp.exp(log_q)
  if options.divergence == "forward_kl":
    grad = q - jnp.exp(log_p)
  else:
    log_ref = log_p
    if options.divergence == "jsd":  # log M
      beta = options.beta
      log_ref = _logaddexp(math.log(beta) + log_ref, math.log1p(-beta) + log_q)
    # The softmax's Jacobian applied to dJ/dQ = log Q - log ref (times 1 - beta
    # for the JSD); 0 where Q is 0 (its log-ratio may be -inf - -inf there).
    spread = q * (log_q - log_ref - per_row(rows.kl, q.shape))
    grad = jnp.where(q > 0, spread, 0.0)
    if options.divergence == "jsd":
      grad = (1.0 - options.beta) * grad
  grad = grad * per_row(rows.coef, grad.shape)
  if rows.hard is not None:
    hard = ce_math.dlogits_block(scores, cols, labels, rows.hard, _PLAIN, vocab_size)
    grad = grad + hard
  head = options.scores
  if head.logit_softcap is not None or head.logit_scale != 1.0:
    grad = grad * ce_math.scores_grad(student_logits, head)
  return jnp.where(per_row(rows.valid, grad.shape), grad, 0.0)


def chunk_loss(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array | None,
  options: DistillOptions,
) -> tuple[jax.Array, jax.Array | None]:
  """Per-row loss of a chunk and, with ``g_loss``, its gradient (in XLA).

  The whole rows are one block of ``block_stats`` and ``dlogits_block``.

  Args:
    student_logits: ``[rows, V]`` raw logits (not scaled or softcapped), any
      float dtype; the math runs in float32 (float64 for float64 logits).
    teacher_logits: ``[rows, V]`` likewise (a constant: not differentiated).
    labels: int32 ``[rows]`` (read only with ``hard_label_weight > 0``).
    valid: bool ``[rows]``; False rows give exactly 0 loss and gradient.
    g_loss: float ``[rows]``, each row's cotangent (0 at excluded rows), or
      None for the loss alone.
    options: the loss options.

  Returns:
    ``(loss, dlogits)``: ``[rows]`` in the math's dtype, and
    ``d sum(g_loss * loss) / d student_logits`` ``[rows, V]`` in that dtype
    (None without ``g_loss``).
  """
  dtype = at_least_float32(student_logits.dtype)
  raw = ce_math.upcast(student_logits)
  teacher = ce_math.upcast(teacher_logits).astype(dtype)
  vocab_size = raw.shape[-1]
  scores, u, v = tempered(raw, teacher, options)
  stats = block_stats(scores, u, v, options)
  sums = target = None
  if options.divergence == "jsd":
    sums = jsd_sums(u, v, log_norms(stats), options.beta)
  if options.hard_label_weight:
    safe = jnp.clip(labels, 0, vocab_size - 1)
    target = jnp.take_along_axis(scores, safe[:, None], axis=-1)[:, 0]
  loss, rows = finish(stats, sums, target, labels, valid, g_loss, options, vocab_size)
  if rows is None:
    return loss, None
  cols = jnp.arange(vocab_size, dtype=jnp.int32)
  return loss, dlogits_block(raw, teacher, cols, labels, rows, options, vocab_size)
