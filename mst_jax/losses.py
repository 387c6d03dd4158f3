"""Losses on log-probabilities: policy gradient, preference, top-k distillation.

The fused head (``mst_jax.linear_log_probs``) gives each token's
log-probability without the ``[tokens, V]`` logits; these losses are the
cheap elementwise step after it: GRPO and its variants (TRL's
``GRPOTrainer``), DPO (TRL's ``DPOTrainer``), SimPO and ORPO (Liger's chunked
preference losses) and a top-k distillation loss. Each function returns
``(loss, metrics)``: the scalar loss and a dict of scalar metrics (under
``stop_gradient``). The math runs in float32 (float64 for float64 inputs):
bfloat16 inputs are upcast, and each gradient comes back in its input's dtype.
Options are static (Python values); the functions are jitted.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from mst_jax._args.options import (
  check_choice,
  check_finite_float,
  check_int,
  public_jit,
)

POLICY_GRADIENT_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING = ("token", "sequence")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def _floating(name: str, x) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {x.dtype}.")
  return x


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
  """float32, or float64 if an input is: the dtype the math runs in."""
  wide = any(x.dtype == jnp.float64 for x in arrays)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _same_shape(name: str, x: jax.Array, like: str, shape: tuple) -> None:
  if x.shape != shape:
    raise ValueError(f"{name} must have {like}'s shape {shape}, got {x.shape}.")


def _keep_mask(name: str, mask, shape: tuple) -> jax.Array:
  """``mask`` as bool: True (or nonzero) keeps a token."""
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {mask.shape}.")
  if mask.dtype == jnp.bool_:
    return mask
  if jnp.issubdtype(mask.dtype, jnp.integer):
    return mask != 0
  raise TypeError(
    f"{name} must be bool or integer (nonzero keeps a token), got {mask.dtype}."
  )


def _non_negative(name: str, value) -> float:
  value = check_finite_float(name, value)
  if value < 0:
    raise ValueError(f"{name} must be >= 0, got {value}.")
  return value


def _positive(name: str, value) -> float:
  value = check_finite_float(name, value)
  if value <= 0:
    raise ValueError(f"{name} must be > 0, got {value}.")
  return value


def _count(mask: jax.Array, dtype, axis=None) -> jax.Array:
  """The number of kept tokens, at least 1 (an empty mean is 0, as TRL's)."""
  return jnp.maximum(jnp.sum(mask, axis=axis), 1).astype(dtype)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, x, 0)) / _count(mask, x.dtype)


@public_jit(
  (
    "loss_type",
    "epsilon_low",
    "epsilon_high",
    "beta",
    "importance_sampling",
    "max_length",
  )
)
def policy_gradient_loss(
  log_probs: jax.Array,
  old_log_probs: jax.Array,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  loss_type: str = "grpo",
  epsilon_low: float = 0.2,
  epsilon_high: float | None = None,
  ref_log_probs: jax.Array | None = None,
  beta: float = 0.0,
  importance_sampling: str = "token",
  max_length: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""The clipped policy-gradient loss of GRPO and its variants (TRL's ``GRPOTrainer``).

  For each kept token ``t`` of sequence ``b``, with ``p = log_probs``,
  ``p_old = old_log_probs``, ``q = ref_log_probs`` and ``d = p - p_old``::

    r[b, t] = exp(d[b, t])                           importance_sampling="token"
    r[b, t] = exp(sum_t' m[b, t'] d[b, t'] / n[b])   "sequence" (GSPO)
    loss[b, t] = -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)
                 + beta (exp(q - p) - (q - p) - 1)

  with ``m`` the mask, ``n[b] = max(sum_t m[b, t], 1)`` and ``A`` the
  advantage (per sequence or per token). The KL term is Schulman's ``k3``
  estimator of ``KL(policy || reference)``, added when ``beta > 0``. The
  tokens' losses are reduced by ``loss_type``:

  - ``"grpo"``: the mean over sequences of each sequence's mean over its kept
    tokens (a sequence with none contributes 0).
  - ``"bnpo"``, ``"dapo"``: the sum over kept tokens / their number (at least
    1). TRL's ``"dapo"`` divides by the kept tokens of the whole
    gradient-accumulation batch over all processes; on one batch that is this.
  - ``"dr_grpo"``: the sum over kept tokens / (B * ``max_length``).

  TRL also divides ``"bnpo"`` and ``"dr_grpo"`` by the number of
  gradient-accumulation steps; that belongs to the training loop. Gradients
  flow to ``log_probs`` only: ``old_log_probs``, ``ref_log_probs`` and
  ``advantages`` are constants (``stop_gradient``). Values at tokens the mask
  drops do not matter (NaN included).

  Args:
    log_probs: ``[B, T]`` float, the current policy's log-probability of each
      token (``mst_jax.linear_log_probs``).
    old_log_probs: ``[B, T]`` float, the sampling policy's.
    advantages: ``[B]`` (one per sequence) or ``[B, T]`` (per token), float.
    mask: ``[B, T]`` bool or integer: True (nonzero) at the completion's
      tokens.
    loss_type: ``"grpo"``, ``"bnpo"``, ``"dapo"`` or ``"dr_grpo"``, above.
    epsilon_low: the clip's lower range, ``r >= 1 - epsilon_low``.
    epsilon_high: its upper range, ``r <= 1 + epsilon_high``; None: ``epsilon_low``
      (DAPO's clip-higher uses 0.28).
    ref_log_probs: ``[B, T]`` float, the reference policy's log-probabilities;
      required when ``beta > 0``, and only then.
    beta: the KL penalty's weight, ``>= 0``.
    importance_sampling: ``"token"`` (a ratio per token) or ``"sequence"`` (one
      per sequence, from the mean of its tokens' log-ratios: GSPO).
    max_length: ``"dr_grpo"``'s constant, the longest completion the sampler
      may write (TRL's ``max_completion_length``); None: T. Only for
      ``"dr_grpo"``.

  Returns:
    ``(loss, metrics)``: the scalar loss, float32 (float64 for float64
    inputs), and a dict of scalars: ``"clip_fraction_low"`` (the fraction of
    kept tokens with ``r < 1 - epsilon_low`` and ``A < 0``, whose gradient
    the clip stops), ``"clip_fraction_high"`` (``r > 1 + epsilon_high`` and
    ``A > 0``) and, when ``beta > 0``, ``"kl"`` (the mean of the KL term over
    kept tokens). These are TRL's ``clip_ratio/low_mean``, ``high_mean`` and
    ``kl``, except that with ``"sequence"`` ratios and ``[B]`` advantages TRL
    averages the clip flags over sequences, and here over kept tokens.

  Raises:
    ValueError: an unknown ``loss_type`` or ``importance_sampling``, shapes
      that do not match, a negative epsilon or beta, ``beta > 0`` without
      ``ref_log_probs`` (or ``ref_log_probs`` with ``beta == 0``),
      ``max_length`` with another loss type or shorter than T.
    TypeError: non-float log-probabilities or advantages, a float mask.

  Example:

    >>> import jax.numpy as jnp
    >>> import mst_jax
    >>> log_probs = jnp.log(jnp.full((2, 4), 0.5))
    >>> mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    >>> loss, metrics = mst_jax.losses.policy_gradient_loss(
    ...     log_probs, log_probs, jnp.array([1.0, -1.0]), mask, loss_type="dapo")
    >>> round(float(loss), 6), float(metrics["clip_fraction_low"])
    (-0.2, 0.0)

  References:
    TRL ``GRPOTrainer._compute_loss``; DeepSeekMath (GRPO), DAPO
    (arXiv:2503.14476), Dr. GRPO (arXiv:2503.20783), GSPO (arXiv:2507.18071).
  """
  check_choice("loss_type", loss_type, POLICY_GRADIENT_LOSS_TYPES)
  check_choice("importance_sampling", importance_sampling, IMPORTANCE_SAMPLING)
  epsilon_low = _non_negative("epsilon_low", epsilon_low)
  epsilon_high = (
    epsilon_low if epsilon_high is None else _non_negative("epsilon_high", epsilon_high)
  )
  beta = _non_negative("beta", beta)
  policy, old, advantages, ref, mask = _policy_gradient_inputs(
    log_probs, old_log_probs, advantages, mask, ref_log_probs, beta
  )
  if max_length is not None:
    if loss_type != "dr_grpo":
      raise ValueError(
        f"max_length is dr_grpo's normaliser; loss_type={loss_type!r} does not use it."
      )
    max_length = check_int("max_length", max_length, minimum=mask.shape[1])

  # Dropped tokens' differences are zeroed before exp, not after: their values
  # are arbitrary, and an inf there would make the gradient NaN through where.
  log_ratio = jnp.where(mask, policy - old, 0)  # [B, T]
  if importance_sampling == "sequence":
    per_sequence = jnp.sum(log_ratio, axis=-1) / _count(mask, policy.dtype, axis=-1)
    log_ratio = per_sequence[:, None]  # [B, 1]
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
  token_loss = -jnp.minimum(ratio * advantages, clipped * advantages)
  token_loss = jnp.broadcast_to(token_loss, mask.shape)  # [B, T]
  clipped_low = (ratio < 1 - epsilon_low) & (advantages < 0)
  clipped_high = (ratio > 1 + epsilon_high) & (advantages > 0)
  metrics = {
    "clip_fraction_low": _masked_mean(_as_tokens(clipped_low, policy), mask),
    "clip_fraction_high": _masked_mean(_as_tokens(clipped_high, policy), mask),
  }
  if beta > 0:
    ref_minus_policy = jnp.where(mask, ref - policy, 0)  # [B, T]
    kl = jnp.exp(ref_minus_policy) - ref_minus_policy - 1
    token_loss = token_loss + beta * kl
    metrics["kl"] = _masked_mean(kl, mask)
  loss = _reduce_tokens(token_loss, mask, loss_type, max_length)
  return loss, lax.stop_gradient(metrics)


def _policy_gradient_inputs(log_probs, old_log_probs, advantages, mask, ref, beta):
  """``policy_gradient_loss``'s arrays checked and upcast: ``(policy, old,
  advantages, ref, mask)``, all but ``policy`` constants; the advantages
  ``[B, 1]`` or ``[B, T]``."""
  log_probs = _floating("log_probs", log_probs)
  if log_probs.ndim != 2:
    raise ValueError(f"log_probs must be [B, T], got shape {log_probs.shape}.")
  shape = log_probs.shape
  old_log_probs = _floating("old_log_probs", old_log_probs)
  _same_shape("old_log_probs", old_log_probs, "log_probs", shape)
  advantages = _floating("advantages", advantages)
  if advantages.shape not in (shape[:1], shape):
    raise ValueError(
      f"advantages must be [B] {shape[:1]} or [B, T] {shape} (log_probs'),"
      f" got {advantages.shape}."
    )
  mask = _keep_mask("mask", mask, shape)
  if beta > 0 and ref is None:
    raise ValueError(
      "beta > 0 needs ref_log_probs, the reference policy's [B, T] log-probs."
    )
  if beta == 0 and ref is not None:
    raise ValueError(
      "ref_log_probs is used only for the KL penalty: pass beta > 0, or leave"
      " ref_log_probs out."
    )
  arrays = [log_probs, old_log_probs, advantages]
  if ref is not None:
    ref = _floating("ref_log_probs", ref)
    _same_shape("ref_log_probs", ref, "log_probs", shape)
    arrays.append(ref)
  dtype = _compute_dtype(*arrays)
  constant = lambda x: None if x is None else lax.stop_gradient(x.astype(dtype))
  advantages = constant(advantages)
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  else:  # dropped tokens' values must not reach a sequence's ratio's gradient
    advantages = jnp.where(mask, advantages, 0)
  return (
    log_probs.astype(dtype),
    constant(old_log_probs),
    advantages,
    constant(ref),
    mask,
  )


def _as_tokens(flag: jax.Array, like: jax.Array) -> jax.Array:
  """A per-token or per-sequence flag as ``[B, T]`` values of ``like``'s dtype."""
  return jnp.broadcast_to(flag, like.shape).astype(like.dtype)


def _reduce_tokens(token_loss, mask, loss_type: str, max_length) -> jax.Array:
  """``[B, T]`` per-token losses to the scalar loss, by ``loss_type``."""
  kept = jnp.where(mask, token_loss, 0)
  if loss_type == "grpo":
    per_sequence = jnp.sum(kept, axis=-1) / _count(mask, kept.dtype, axis=-1)
    return jnp.mean(per_sequence)
  if loss_type == "dr_grpo":
    batch, length = mask.shape
    return jnp.sum(kept) / (batch * (max_length or length))
  return jnp.sum(kept) / _count(mask, kept.dtype)


def _per_sequence(names: tuple[str, ...], arrays: tuple) -> list[jax.Array]:
  """Per-sequence inputs checked ([B] floats of one shape), upcast."""
  arrays = [_floating(name, x) for name, x in zip(names, arrays, strict=True)]
  if arrays[0].ndim != 1:
    raise ValueError(f"{names[0]} must be [B], got shape {arrays[0].shape}.")
  for name, x in zip(names[1:], arrays[1:], strict=True):
    _same_shape(name, x, names[0], arrays[0].shape)
  dtype = _compute_dtype(*arrays)
  return [x.astype(dtype) for x in arrays]


def _reward_metrics(chosen: jax.Array, rejected: jax.Array) -> dict[str, jax.Array]:
  """TRL's ``rewards/*`` metrics from ``[B]`` implicit rewards."""
  return {
    "chosen_rewards": jnp.mean(chosen),
    "rejected_rewards": jnp.mean(rejected),
    "reward_accuracy": jnp.mean(chosen > rejected).astype(chosen.dtype),
    "reward_margin": jnp.mean(chosen - rejected),
  }


def _smoothed_sigmoid_loss(logits: jax.Array, label_smoothing: float) -> jax.Array:
  """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``: a binary
  cross-entropy towards ``1 - eps`` (cDPO's conservative labels)."""
  loss = -jax.nn.log_sigmoid(logits)
  if label_smoothing:
    loss = (1 - label_smoothing) * loss - label_smoothing * jax.nn.log_sigmoid(-logits)
  return loss


def _label_smoothing(value) -> float:
  value = _non_negative("label_smoothing", value)
  if value > 0.5:
    raise ValueError(
      f"label_smoothing must be in [0, 0.5] (the chance that a pair's labels"
      f" are flipped), got {value}."
    )
  return value


@public_jit(("beta", "loss_type", "label_smoothing"))
def dpo_loss(
  chosen_log_probs: jax.Array,
  rejected_log_probs: jax.Array,
  ref_chosen_log_probs: jax.Array,
  ref_rejected_log_probs: jax.Array,
  *,
  beta: float = 0.1,
  loss_type: str = "sigmoid",
  label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""Direct preference optimisation's loss (TRL's ``DPOTrainer``).

  With the policy's and the reference's log-probabilities of each pair's
  chosen (``c``, ``c_ref``) and rejected (``r``, ``r_ref``) responses::

    h = (c - r) - (c_ref - r_ref)
    "sigmoid": -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    "ipo":     (h - 1 / (2 beta))**2
    "hinge":   max(0, 1 - beta h)

  averaged over the B pairs. ``eps`` is ``label_smoothing`` (cDPO / robust
  DPO's conservative labels), for ``"sigmoid"`` only.

  The inputs are each response's summed log-probabilities over its tokens
  (``jnp.sum(jnp.where(mask, log_probs, 0), -1)``), as TRL's DPO. For
  ``"ipo"`` TRL averages over the response's tokens instead: pass the
  per-token means to match it. Gradients flow to ``chosen_log_probs`` and
  ``rejected_log_probs`` only (the reference's are constants).

  Args:
    chosen_log_probs: ``[B]`` float, the policy's log-probability of each
      chosen response.
    rejected_log_probs: ``[B]`` float, of each rejected response.
    ref_chosen_log_probs: ``[B]`` float, the reference model's of each chosen
      response.
    ref_rejected_log_probs: ``[B]`` float, of each rejected response.
    beta: ``> 0``, the inverse temperature (IPO's ``1 / (2 tau)`` target uses
      it as ``tau``).
    loss_type: ``"sigmoid"``, ``"ipo"`` or ``"hinge"``.
    label_smoothing: ``eps`` in ``[0, 0.5]``; ``"sigmoid"`` only.

  Returns:
    ``(loss, metrics)``: the scalar loss, float32 (float64 for float64
    inputs), and TRL's reward metrics, means over the pairs of the implicit
    rewards ``beta (c - c_ref)`` and ``beta (r - r_ref)``:
    ``"chosen_rewards"``, ``"rejected_rewards"``, ``"reward_accuracy"`` (the
    fraction of pairs whose chosen reward is the larger) and
    ``"reward_margin"`` (chosen minus rejected).

  Raises:
    ValueError: an unknown ``loss_type``, ``beta <= 0``, ``label_smoothing``
      outside ``[0, 0.5]`` or with a loss type other than ``"sigmoid"``,
      inputs that are not one ``[B]`` shape.
    TypeError: non-float inputs.

  Example:

    >>> import jax.numpy as jnp
    >>> import mst_jax
    >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-11.0, -9.0])
    >>> loss, metrics = mst_jax.losses.dpo_loss(
    ...     chosen, rejected, chosen - 1.0, rejected, beta=0.5)
    >>> float(metrics["reward_accuracy"])
    1.0

  References:
    TRL ``DPOTrainer.dpo_loss``; DPO (arXiv:2305.18290), IPO
    (arXiv:2310.12036), hinge / SLiC (arXiv:2305.10425).
  """
  check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
  beta = _positive("beta", beta)
  label_smoothing = _label_smoothing(label_smoothing)
  if label_smoothing and loss_type != "sigmoid":
    raise ValueError(
      f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}."
    )
  names = (
    "chosen_log_probs",
    "rejected_log_probs",
    "ref_chosen_log_probs",
    "ref_rejected_log_probs",
  )
  arrays = (
    chosen_log_probs,
    rejected_log_probs,
    ref_chosen_log_probs,
    ref_rejected_log_probs,
  )
  chosen, rejected, ref_chosen, ref_rejected = _per_sequence(names, arrays)
  chosen_ratio = chosen - lax.stop_gradient(ref_chosen)  # [B]
  rejected_ratio = rejected - lax.stop_gradient(ref_rejected)
  h = chosen_ratio - rejected_ratio
  if loss_type == "sigmoid":
    losses = _smoothed_sigmoid_loss(beta * h, label_smoothing)
  elif loss_type == "ipo":
    losses = (h - 1 / (2 * beta)) ** 2
  else:
    losses = jax.nn.relu(1 - beta * h)
  metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
  return jnp.mean(losses), lax.stop_gradient(metrics)


@public_jit(("beta", "gamma", "label_smoothing"))
def simpo_loss(
  chosen_log_probs: jax.Array,
  rejected_log_probs: jax.Array,
  *,
  beta: float = 0.1,
  gamma: float = 0.5,
  label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""SimPO's reference-free preference loss (Liger's ``LigerFusedLinearSimPOLoss``).

  With each pair's length-averaged log-probabilities ``c`` (chosen) and ``r``
  (rejected)::

    z    = beta (c - r) - gamma
    loss = mean over pairs of -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)

  The inputs are each response's mean log-probability over its tokens
  (``jnp.sum(jnp.where(mask, lp, 0), -1) / jnp.sum(mask, -1)``), as Liger's
  preference losses take them. The defaults are Liger's (the SimPO paper
  tunes ``beta`` in 2-10 and ``gamma / beta`` in 0.3-1.6). Liger's module can
  also add the chosen responses' NLL (``compute_nll_loss``, weight ``alpha``):
  add ``alpha * mst_jax.linear_cross_entropy(...)`` on them for that.

  Args:
    chosen_log_probs: ``[B]`` float, each chosen response's mean token
      log-probability.
    rejected_log_probs: ``[B]`` float, each rejected response's.
    beta: ``> 0``, the reward scale.
    gamma: the target reward margin.
    label_smoothing: ``eps`` in ``[0, 0.5]``.

  Returns:
    ``(loss, metrics)``: the scalar loss, float32 (float64 for float64
    inputs), and the means over pairs of the rewards ``beta c`` and ``beta r``:
    ``"chosen_rewards"``, ``"rejected_rewards"``, ``"reward_accuracy"`` and
    ``"reward_margin"``, as for ``dpo_loss``.

  Raises:
    ValueError: ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5]``,
      inputs that are not one ``[B]`` shape.
    TypeError: non-float inputs.

  Example:

    >>> import jax.numpy as jnp
    >>> import mst_jax
    >>> loss, metrics = mst_jax.losses.simpo_loss(
    ...     jnp.array([-0.5, -0.9]), jnp.array([-1.5, -0.7]), beta=2.0, gamma=1.0)
    >>> float(metrics["reward_accuracy"])
    0.5

  References:
    Liger ``LigerFusedLinearSimPOFunction.preference_loss_fn``; SimPO
    (arXiv:2405.14734).
  """
  beta = _positive("beta", beta)
  gamma = check_finite_float("gamma", gamma)
  label_smoothing = _label_smoothing(label_smoothing)
  names = ("chosen_log_probs", "rejected_log_probs")
  chosen, rejected = _per_sequence(names, (chosen_log_probs, rejected_log_probs))
  losses = _smoothed_sigmoid_loss(beta * (chosen - rejected) - gamma, label_smoothing)
  metrics = _reward_metrics(beta * chosen, beta * rejected)
  return jnp.mean(losses), lax.stop_gradient(metrics)


def _log1m_exp(x: jax.Array) -> jax.Array:
  """``log(1 - exp(x))`` for ``x < 0``, accurate near 0 and far below it
  (Maechler's switch at ``-log 2``)."""
  near_zero = x > -math.log(2)
  safe = jnp.where(near_zero, x, -1.0)  # each branch sees finite inputs
  far = jnp.where(near_zero, -1.0, x)
  return jnp.where(near_zero, jnp.log(-jnp.expm1(safe)), jnp.log1p(-jnp.exp(far)))


@public_jit(("beta",))
def orpo_loss(
  chosen_log_probs: jax.Array,
  rejected_log_probs: jax.Array,
  *,
  beta: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""ORPO's odds-ratio term (Liger's ``LigerFusedLinearORPOLoss``).

  With each pair's length-averaged log-probabilities ``c`` (chosen) and ``r``
  (rejected), and ``log odds(p) = p - log(1 - exp(p))``::

    log_odds = log odds(c) - log odds(r)
    loss     = -beta mean over pairs of log sigmoid(log_odds)

  The inputs are each response's mean log-probability over its tokens, as
  Liger's and TRL's ORPO take them; they must be below 0 (a mean probability
  below 1). ORPO's objective is this plus the chosen responses' NLL, which
  Liger adds (``compute_nll_loss=True``, the mean over the chosen responses'
  tokens): add ``mst_jax.linear_cross_entropy(...)`` on them for that.

  Args:
    chosen_log_probs: ``[B]`` float, each chosen response's mean token
      log-probability (< 0).
    rejected_log_probs: ``[B]`` float, each rejected response's (< 0).
    beta: ``> 0``, the odds-ratio term's weight (the paper's lambda).

  Returns:
    ``(loss, metrics)``: the scalar loss, float32 (float64 for float64
    inputs), and Liger's metrics as means over pairs: the rewards ``beta c``
    and ``beta r`` (``"chosen_rewards"``, ``"rejected_rewards"``,
    ``"reward_accuracy"``, ``"reward_margin"``, as for ``dpo_loss``),
    ``"log_odds_ratio"`` (the mean of ``log sigmoid(log_odds)``) and
    ``"log_odds_chosen"`` (the mean of ``log_odds``).

  Raises:
    ValueError: ``beta <= 0``, inputs that are not one ``[B]`` shape.
    TypeError: non-float inputs.

  Example:

    >>> import jax.numpy as jnp
    >>> import mst_jax
    >>> loss, metrics = mst_jax.losses.orpo_loss(
    ...     jnp.array([-0.5, -0.9]), jnp.array([-1.5, -0.7]))
    >>> float(metrics["reward_accuracy"])
    0.5

  References:
    Liger ``LigerFusedLinearORPOFunction.preference_loss_fn``; TRL
    ``ORPOTrainer.odds_ratio_loss``; ORPO (arXiv:2403.07691).
  """
  beta = _positive("beta", beta)
  names = ("chosen_log_probs", "rejected_log_probs")
  chosen, rejected = _per_sequence(names, (chosen_log_probs, rejected_log_probs))
  log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
  log_sigmoid = jax.nn.log_sigmoid(log_odds)  # [B]
  metrics = {
    **_reward_metrics(beta * chosen, beta * rejected),
    "log_odds_ratio": jnp.mean(log_sigmoid),
    "log_odds_chosen": jnp.mean(log_odds),
  }
  return -beta * jnp.mean(log_sigmoid), lax.stop_gradient(metrics)


@public_jit(())
def top_k_distillation_loss(
  student_log_probs: jax.Array,
  teacher_log_probs: jax.Array,
  *,
  where: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  r"""Forward KL from a teacher's stored top-k log-probabilities.

  For each token, with the teacher's log-probabilities ``t_k`` of its K stored
  ids and the student's ``s_k`` of the same ids::

    loss_token = sum_k exp(t_k) (t_k - s_k)

  averaged over the tokens ``where`` keeps (all if None; 0.0 if none). This is
  the K ids' part of ``KL(teacher || student)``: the teacher's mass outside
  them contributes nothing. For the KL between the two distributions
  restricted to the K ids, renormalise both first
  (``jax.nn.log_softmax(x, axis=-1)``). A teacher log-probability of ``-inf``
  (an unused slot) contributes 0. Gradients flow to ``student_log_probs`` only.

  Args:
    student_log_probs: ``[..., K]`` float, the student's log-probabilities of
      the teacher's top-k ids (its full ``log_softmax`` gathered at them).
    teacher_log_probs: ``[..., K]`` float, the teacher's.
    where: ``[...]`` bool or integer, True (nonzero) at the tokens to average;
      None: all.

  Returns:
    ``(loss, metrics)``: the scalar loss, float32 (float64 for float64
    inputs), and ``{"teacher_mass": ...}``, the mean over kept tokens of
    ``sum_k exp(t_k)``, the teacher probability the K ids hold.

  Raises:
    ValueError: shapes that differ, or a ``where`` of another shape than
      ``[...]``.
    TypeError: non-float log-probabilities, a float ``where``.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> teacher = jax.nn.log_softmax(jnp.array([[3.0, 1.0, 0.0]]))
    >>> loss, metrics = mst_jax.losses.top_k_distillation_loss(teacher, teacher)
    >>> float(loss), round(float(metrics["teacher_mass"]), 6)
    (0.0, 1.0)

  References:
    The top-k KL of offline distillation (Gemma 2's, arXiv:2408.00118);
    Liger's ``LigerFusedLinearDistillationBase`` for the full-vocabulary one
    (``mst_jax.linear_distillation_loss``).
  """
  student = _floating("student_log_probs", student_log_probs)
  teacher = _floating("teacher_log_probs", teacher_log_probs)
  if student.ndim < 1:
    raise ValueError(f"student_log_probs must be [..., K], got shape {student.shape}.")
  _same_shape("teacher_log_probs", teacher, "student_log_probs", student.shape)
  if where is None:
    where = jnp.ones(student.shape[:-1], bool)
  where = _keep_mask("where", where, student.shape[:-1])
  dtype = _compute_dtype(student, teacher)
  keep = where[..., None]  # [..., 1]
  # Dropped tokens' values are arbitrary: zeroed before any arithmetic, so
  # that a NaN there reaches neither the loss nor the gradient.
  student = jnp.where(keep, student.astype(dtype), 0)
  teacher = lax.stop_gradient(jnp.where(keep, teacher.astype(dtype), 0))
  probs = jnp.exp(teacher)  # [..., K]
  terms = jnp.where(probs > 0, probs * (teacher - student), 0)
  loss = _masked_mean(jnp.sum(terms, axis=-1), where)
  metrics = {"teacher_mass": _masked_mean(jnp.sum(probs, axis=-1), where)}
  return loss, lax.stop_gradient(metrics)
