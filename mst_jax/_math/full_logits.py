"""The loss from the full ``[N, V]`` logits, plainly (``impl="reference"``).

It forms the whole logits and differentiates by autodiff, so it is the test
oracle (run on float64 inputs) and the documentation of what every fast path
computes. It is written from the definition
``-(1 - eps) * log p_y - eps * mean_j log p_j + zl * lse**2`` (and the
entropy ``-sum_j p_j log p_j``) with
``log p = log_softmax(softcap(logit_scale * logits))``, independently of the
blockwise math in ``_math.ce`` that the fast paths share (it takes only its
options).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._math.ce import CEOptions, at_least_float32


def full_logits(hidden, weight, bias, valid, weight_layout: str) -> jax.Array:
  """``[N, V]`` logits of the valid rows (0 at excluded rows), in at least
  float32, at the highest matmul precision.

  A plain transpose rather than the fast paths' layout-aware dot: the
  references share nothing with them but the options.
  """
  acc = at_least_float32(hidden.dtype)
  w = weight if weight_layout == "dv" else weight.T
  # Excluded rows never reach the logits: a NaN there changes nothing.
  hidden = jnp.where(valid[:, None], hidden, jnp.zeros_like(hidden))
  logits = jnp.dot(
    hidden, w, preferred_element_type=acc, precision=lax.Precision.HIGHEST
  )
  if bias is not None:
    logits = logits + bias.astype(acc)[None, :]
  return logits


def row_losses(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array | None,
  labels: jax.Array,
  valid: jax.Array,
  class_weights: jax.Array | None = None,
  target_weight: jax.Array | None = None,
  mean_weight: jax.Array | None = None,
  ids: jax.Array | None = None,
  *,
  options: CEOptions,
  weight_layout: str,
) -> tuple[jax.Array, ...]:
  """Per-row ``(loss, lse, correct, entropy)`` from the full logits, and
  with ``ids`` the logits at them.

  Args:
    hidden: ``[N, D]``.
    weight: ``[V, D]`` (``weight_layout="vd"``) or ``[D, V]`` (``"dv"``).
    bias: ``[V]`` or None.
    labels: int32 ``[N]``.
    valid: bool ``[N]``.
    class_weights: ``[V]`` or None (torch's ``weight``).
    target_weight, mean_weight: the per-row class factors the chunked paths
      take (``Rows.arrays``); the reference derives its own from
      ``class_weights``.
    ids: int32 ``[N, K]`` in ``[0, V)``, or None.
    options: the loss options.
    weight_layout: ``"vd"`` or ``"dv"``.

  Returns:
    ``[N]`` loss (float32, or float64 for float64 inputs; NaN for a valid row
    whose label is outside ``[0, V)``; 0 at invalid rows), ``[N]`` lse (0 at
    invalid rows), ``[N]`` bool, whether the argmax is the label, and ``[N]``
    entropy of the softmax (with ``options.entropy``, else zeros; 0 at
    invalid rows); with ``ids``, ``[N, K]`` logits at them (0 at invalid
    rows).
  """
  del target_weight, mean_weight
  logits = full_logits(hidden, weight, bias, valid, weight_layout)
  outputs = losses_from_logits(
    logits, labels, valid, options=options, class_weights=class_weights
  )
  if ids is None:
    return outputs
  at_ids = jnp.take_along_axis(logits, ids, axis=1)
  return (*outputs, jnp.where(valid[:, None], at_ids, 0))


def losses_from_logits(
  logits: jax.Array,
  labels: jax.Array,
  valid: jax.Array,
  *,
  options: CEOptions,
  class_weights: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Per-row ``(loss, lse, correct, entropy)`` from ``[N, V]`` logits; see
  ``row_losses``."""
  vocab_size = logits.shape[-1]
  in_range = (labels >= 0) & (labels < vocab_size)
  logits = logits * options.logit_scale
  cap = options.logit_softcap
  if cap is not None:
    logits = cap * jnp.tanh(logits / cap)
  clean = logits  # the entropy's: it does not read the label
  # A valid row's label outside [0, V) is an error: its loss and gradients
  # are NaN (not a loss of NaN with finite gradients).
  logits = logits + jnp.where(valid & ~in_range, jnp.nan, 0.0)[:, None]
  log_probs = jax.nn.log_softmax(logits, axis=-1)  # [N, V]
  safe_labels = jnp.where(in_range, labels, 0)
  log_p_label = jnp.take_along_axis(log_probs, safe_labels[:, None], axis=-1)[:, 0]
  log_p_label = jnp.where(in_range, log_p_label, jnp.nan)
  lse = jax.nn.logsumexp(logits, axis=-1)
  eps = options.label_smoothing
  # The smoothing term only with eps > 0: a banned class (log p = -inf)
  # would make eps * mean(log p) = 0 * -inf = NaN.
  if class_weights is None:
    loss = -(1.0 - eps) * log_p_label
    if eps:
      loss = loss - eps * jnp.mean(log_probs, axis=-1)
  else:  # torch: -(1 - eps) w_y log p_y - (eps / V) sum_c w_c log p_c
    w = class_weights.astype(logits.dtype)
    w_label = jnp.where(in_range, w[safe_labels], 0.0)
    loss = -(1.0 - eps) * w_label * log_p_label
    if eps:
      weighted = jnp.where(w[None, :] > 0, log_probs * w[None, :], 0.0)
      loss = loss - eps * jnp.sum(weighted, axis=-1) / vocab_size
  loss = loss + options.z_loss * jnp.square(lse)
  correct = valid & (jnp.argmax(logits, axis=-1) == labels)
  zero = jnp.zeros_like(lse)
  entropy = zero
  if options.entropy:
    # -sum p log p; a class of probability 0 adds 0, not 0 * -inf.
    log_p = jax.nn.log_softmax(clean, axis=-1)
    probs = jnp.exp(log_p)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * log_p, 0.0), axis=-1)
  return (
    jnp.where(valid, loss, zero),
    jnp.where(valid, lse, zero),
    correct,
    jnp.where(valid, entropy, zero),
  )
