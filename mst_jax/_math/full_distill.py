"""The distillation loss from the full ``[N, V]`` logits of both heads, plainly.

``impl="reference"`` of ``linear_distillation_loss``: it forms both heads'
whole logits and is differentiated by autodiff, so it is the test oracle (run
on float64 inputs) for the chunked path's hand-written gradient. It is written
from the definitions (``P = softmax(s_t / T)``, ``Q = softmax(s_s / T)``,
``M = beta P + (1 - beta) Q``, the KL divergences as sums of ``P log(P / Q)``),
independently of ``_math.distill``, whose options it takes; the hard-label term
is the cross-entropy reference's (``_math.full_logits``). The logarithms come from
``log_softmax`` (``log M`` from ``logaddexp``), not from the probabilities: a
probability that underflows to 0 beside a small nonzero one would make
``log(P / Q)`` infinite where the divergence is finite.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._math import full_logits
from mst_jax._math.distill import DistillOptions


def row_losses(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array | None,
  teacher_hidden: jax.Array,
  teacher_weight: jax.Array,
  teacher_bias: jax.Array | None,
  labels: jax.Array,
  valid: jax.Array,
  *,
  options: DistillOptions,
  weight_layout: str,
) -> jax.Array:
  """Per-row loss from both heads' full logits (0 at invalid rows).

  Args:
    hidden, weight, bias: the student's ``[N, D_s]``, ``[V, D_s]`` (``"vd"``)
      or ``[D_s, V]`` (``"dv"``), ``[V]`` or None.
    teacher_hidden, teacher_weight, teacher_bias: the teacher's, likewise with
      ``D_t``; not differentiated (``lax.stop_gradient``).
    labels: int32 ``[N]``.
    valid: bool ``[N]``.
    options: the loss options.
    weight_layout: ``"vd"`` or ``"dv"``.

  Returns:
    ``[N]`` float32 (float64 for float64 inputs).
  """
  teacher = lax.stop_gradient((teacher_hidden, teacher_weight, teacher_bias))
  student_logits = full_logits.full_logits(hidden, weight, bias, valid, weight_layout)
  teacher_logits = full_logits.full_logits(*teacher, valid, weight_layout)
  return losses_from_logits(
    student_logits, teacher_logits.astype(student_logits.dtype), labels, valid, options
  )


def _kl(log_a: jax.Array, log_b: jax.Array) -> jax.Array:
  """``sum_j a_j log(a_j / b_j)`` per row, from ``log a`` and ``log b``. A
  class with ``a_j = 0`` adds 0; the inner ``where`` keeps its gradient finite
  too."""
  a = jnp.exp(log_a)
  present = a > 0
  log_ratio = jnp.where(present, log_a, 0.0) - jnp.where(present, log_b, 0.0)
  return jnp.sum(jnp.where(present, a * log_ratio, 0.0), axis=-1)


def losses_from_logits(
  student_logits: jax.Array,
  teacher_logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  options: DistillOptions,
) -> jax.Array:
  """Per-row loss from ``[N, V]`` raw logits of both heads; see ``row_losses``."""
  head, temperature = options.scores, options.temperature

  def log_probs(logits):
    scores = logits * head.logit_scale
    if head.logit_softcap is not None:
      scores = head.logit_softcap * jnp.tanh(scores / head.logit_softcap)
    return jax.nn.log_softmax(scores / temperature, axis=-1)

  log_q, log_p = log_probs(student_logits), log_probs(teacher_logits)
  if options.divergence == "forward_kl":
    loss = _kl(log_p, log_q)
  elif options.divergence == "reverse_kl":
    loss = _kl(log_q, log_p)
  else:
    beta = options.beta
    # Where both are -inf (a class banned in both heads), so is log M; the
    # inner where keeps logaddexp's gradient there finite.
    both = (log_p == -jnp.inf) & (log_q == -jnp.inf)
    log_m = jnp.logaddexp(
      math.log(beta) + jnp.where(both, 0.0, log_p),
      math.log1p(-beta) + jnp.where(both, 0.0, log_q),
    )
    log_m = jnp.where(both, -jnp.inf, log_m)
    loss = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
  loss = jnp.maximum(loss, 0.0)  # rounding can take P ~ Q's sums below 0
  if options.hard_label_weight:
    # The student's cross-entropy at temperature 1, the CE reference's.
    hard, *_ = full_logits.losses_from_logits(
      student_logits, labels, valid, options=head
    )
    loss = loss + options.hard_label_weight * hard
  return jnp.where(valid, loss, jnp.zeros_like(loss))
