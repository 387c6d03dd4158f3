"""The per-row distillation math, written once: divergences and their gradients.

For one token with the student's raw logits ``z_s`` and the teacher's ``z_t``
(each ``[V]``), both heads' scores are formed as in the cross-entropy
(``_ce_math.scores``: ``s = c * tanh(a z / c)``, or ``a z`` without a softcap)
and divided by the temperature ``T``::

  log Q = log_softmax(s_s / T)        (the student)
  log P = log_softmax(s_t / T)        (the teacher)

  forward_kl:  KL(P || Q) = sum_j P_j (log P_j - log Q_j)
  reverse_kl:  KL(Q || P) = sum_j Q_j (log Q_j - log P_j)
  jsd:         beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q

  loss = divergence + h * (lse(s_s) - s_s[y])     (h = hard_label_weight)

The hard-label term is the cross-entropy of the student's scores at
temperature 1 (``_ce_math``'s formulas). A class of probability 0 (a score of
-inf, a banned token) adds 0 to a sum, not ``0 * -inf``; ``log M`` is
``logaddexp(log beta + log P, log(1 - beta) + log Q)``, finite wherever ``P``
or ``Q`` is not 0.

The gradient with respect to ``u = s_s / T`` (the teacher is a constant)::

  forward_kl:  Q_j - P_j
  reverse_kl:  Q_j (r_j - KL(Q || P)),          r = log Q - log P
  jsd:         (1 - beta) Q_j (d_j - KL(Q || M)), d = log Q - log M

(for the JSD, ``dJ/dQ_j = (1 - beta)(log Q_j - log M_j)`` through the
softmax). Then ``d/ds = (1 / T) d/du + h (softmax(s_s) - onehot(y))`` and
``d/dz = d/ds * ds/dz`` (``_ce_math.scores_grad``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mst_jax import _ce_math
from mst_jax._ce_math import CEOptions, RowStats, at_least_float32

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


def _log_softmax(u: jax.Array) -> jax.Array:
  """``log_softmax`` over the last axis, from the row's max (a row of -inf
  scores shifts by 0, not by -inf)."""
  row_max = jnp.max(u, axis=-1, keepdims=True)
  shifted = u - jnp.where(row_max > -jnp.inf, row_max, 0.0)
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def _kl_rows(p: jax.Array, log_p: jax.Array, log_other: jax.Array) -> jax.Array:
  """``sum_j p_j (log p_j - log other_j)`` per row; classes with ``p = 0`` add 0."""
  return jnp.sum(jnp.where(p > 0, p * (log_p - log_other), 0.0), axis=-1)


def _divergence(
  log_q: jax.Array, log_p: jax.Array, options: DistillOptions, grad: bool
) -> tuple[jax.Array, jax.Array | None]:
  """Per-row divergence ``[rows]`` and, with ``grad``, its gradient with
  respect to the student's tempered scores ``u`` (``[rows, V]``)."""
  q, p = jnp.exp(log_q), jnp.exp(log_p)
  if options.divergence == "forward_kl":
    return _kl_rows(p, log_p, log_q), (q - p) if grad else None
  if options.divergence == "reverse_kl":
    log_ref, weight = log_p, 1.0
    divergence = kl_q = _kl_rows(q, log_q, log_p)
  else:
    beta = options.beta
    log_ref = jnp.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)
    kl_q = _kl_rows(q, log_q, log_ref)
    divergence = beta * _kl_rows(p, log_p, log_ref) + (1.0 - beta) * kl_q
    weight = 1.0 - beta
  if not grad:
    return divergence, None
  # Q_j (log Q_j - log ref_j - KL(Q || ref)): the softmax's Jacobian applied to
  # dJ/dQ; 0 where Q_j is 0 (its log-ratio may be -inf - -inf there).
  spread = jnp.where(q > 0, q * (log_q - log_ref - kl_q[:, None]), 0.0)
  return divergence, weight * spread if weight != 1.0 else spread


def _hard_label(
  scores: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array | None,
) -> tuple[jax.Array, jax.Array | None]:
  """The cross-entropy of ``scores`` ``[rows, V]`` at the labels, per row, and
  with ``g_loss`` its gradient ``g_loss * (softmax - onehot)``, by
  ``_ce_math``'s formulas (NaN at a valid row whose label is outside ``[0, V)``)."""
  vocab_size = scores.shape[-1]
  row_max = jnp.max(scores, axis=-1)
  shift = jnp.where(row_max > -jnp.inf, row_max, 0.0)
  log_sum_exp = jnp.log(jnp.sum(jnp.exp(scores - shift[:, None]), axis=-1))
  safe = jnp.clip(labels, 0, vocab_size - 1)
  target = jnp.take_along_axis(scores, safe[:, None], axis=-1)[:, 0]
  zeros = jnp.zeros_like(shift)
  stats = RowStats(shift, log_sum_exp, target, zeros, jnp.zeros_like(labels))
  plain = CEOptions()  # the scores are already scaled and softcapped
  loss, lse, _, _ = _ce_math.row_outputs(stats, labels, valid, plain, vocab_size)
  if g_loss is None:
    return loss, None
  rows = _ce_math.backward_rows(g_loss, zeros, lse, labels, valid, plain, vocab_size)
  cols = jnp.arange(vocab_size, dtype=jnp.int32)
  grad = _ce_math.dlogits_block(scores, cols, labels, rows, plain, vocab_size)
  return loss, grad


def chunk_loss(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  g_loss: jax.Array | None,
  options: DistillOptions,
) -> tuple[jax.Array, jax.Array | None]:
  """Per-row loss of a chunk and, with ``g_loss``, its gradient.

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
  raw = student_logits.astype(dtype)
  scores = _ce_math.scores(raw, options.scores)  # [rows, V]
  teacher = _ce_math.scores(teacher_logits.astype(dtype), options.scores)
  student, temperature = scores, options.temperature
  if temperature != 1.0:
    student, teacher = scores / temperature, teacher / temperature
  log_q, log_p = _log_softmax(student), _log_softmax(teacher)  # [rows, V]
  grad = g_loss is not None
  loss, dscores = _divergence(log_q, log_p, options, grad)
  if grad:
    coef = jnp.where(valid, g_loss.astype(dtype), 0.0)
    dscores = dscores * (coef / temperature)[:, None]
  weight = options.hard_label_weight
  if weight:
    g_hard = None if not grad else weight * coef
    hard, dhard = _hard_label(scores, labels, valid, g_hard)
    loss = loss + weight * hard
    if grad:
      dscores = dscores + dhard
  loss = jnp.where(valid, loss, jnp.zeros_like(loss))
  if not grad:
    return loss, None
  head = options.scores
  if head.logit_softcap is not None or head.logit_scale != 1.0:
    dscores = dscores * _ce_math.scores_grad(raw, head)
  return loss, jnp.where(valid[:, None], dscores, 0.0)
