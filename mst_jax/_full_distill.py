"""The distillation loss from the full ``[N, V]`` logits of both heads, plainly.

``impl="reference"`` of ``linear_distillation_loss``: it forms both heads'
whole logits and is differentiated by autodiff, so it is the test oracle (run
on float64 inputs) for the chunked path's hand-written gradient. It is written
from the definitions (``P = softmax(s_t / T)``, ``Q = softmax(s_s / T)``,
``M = beta P + (1 - beta) Q``, the KL divergences as sums of ``P log(P / Q)``),
independently of ``_distill_math``, whose options it takes; the hard-label term
is the cross-entropy reference's (``_full_logits``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax import _full_logits
from mst_jax._distill_math import DistillOptions


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
  student_logits = _full_logits.full_logits(hidden, weight, bias, valid, weight_layout)
  teacher_logits = _full_logits.full_logits(*teacher, valid, weight_layout)
  return losses_from_logits(
    student_logits, teacher_logits.astype(student_logits.dtype), labels, valid, options
  )


def _kl(a: jax.Array, b: jax.Array) -> jax.Array:
  """``sum_j a_j log(a_j / b_j)`` per row, by the definition. A class with
  ``a_j = 0`` adds 0; the inner ``where`` keeps its gradient finite too."""
  present = a > 0
  log_ratio = jnp.log(jnp.where(present, a, 1.0)) - jnp.log(jnp.where(present, b, 1.0))
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

  def probs(logits):
    scores = logits * head.logit_scale
    if head.logit_softcap is not None:
      scores = head.logit_softcap * jnp.tanh(scores / head.logit_softcap)
    return jax.nn.softmax(scores / temperature, axis=-1)

  q, p = probs(student_logits), probs(teacher_logits)
  if options.divergence == "forward_kl":
    loss = _kl(p, q)
  elif options.divergence == "reverse_kl":
    loss = _kl(q, p)
  else:
    beta = options.beta
    m = beta * p + (1.0 - beta) * q
    loss = beta * _kl(p, m) + (1.0 - beta) * _kl(q, m)
  if options.hard_label_weight:
    # The student's cross-entropy at temperature 1, the CE reference's.
    hard, *_ = _full_logits.losses_from_logits(
      student_logits, labels, valid, options=head
    )
    loss = loss + options.hard_label_weight * hard
  return jnp.where(valid, loss, jnp.zeros_like(loss))
