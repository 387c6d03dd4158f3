"""``mst_jax.losses`` against float64 references written from the formulas.

Each reference below is written from the loss's definition (TRL's and
Liger's), sharing no code with the library; it takes an array module ``xp``:
numpy for the float64 values and metrics, ``jax.numpy`` under
``jax.enable_x64`` for the float64 gradients. Inputs are rounded to the
tested dtype first and the references read the rounded values, so the
library's error is its float32 arithmetic (and, for bfloat16 inputs, the
gradient's rounding to bfloat16).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import to64

from mst_jax import losses

# Unaligned on purpose.
B, T, K = 5, 37, 7
DTYPES = ["float32", "bfloat16"]
# The math runs in float32 on the rounded inputs, whatever their dtype.
LOSS_TOL = {"float32": 1e-5, "bfloat16": 1e-5}
# Gradients come back in the input's dtype: a bfloat16 one is off by up to
# half its 8-bit significand's unit, 2**-8 relative.
GRAD_RTOL = {"float32": 1e-5, "bfloat16": 5e-3}


def _cast(dtype, *arrays):
  return [jnp.asarray(x, dtype) for x in arrays]


def _assert_grad_close(grad, ref, dtype):
  assert grad.dtype == jnp.dtype(dtype)
  grad, ref = to64(grad), np.asarray(ref, np.float64)
  error = np.linalg.norm(grad - ref)
  assert error <= GRAD_RTOL[dtype] * np.linalg.norm(ref), (error, np.linalg.norm(ref))


def _assert_metrics_close(metrics, expected, dtype):
  assert sorted(metrics) == sorted(expected)
  for name, value in expected.items():
    assert metrics[name].dtype == jnp.float32, name
    np.testing.assert_allclose(
      float(metrics[name]), value, rtol=LOSS_TOL[dtype], atol=LOSS_TOL[dtype]
    )


def _value_and_grad(fn, argnums=0):
  """``jax.value_and_grad(fn, argnums, has_aux=True)``, compiled as one
  program (half the compile time of differentiating the jitted losses
  eagerly)."""
  return jax.jit(jax.value_and_grad(fn, argnums, has_aux=True))


def _grad64(reference, argnum, *args, **kwargs):
  """The float64 gradient of ``reference(jnp, *args, **kwargs)[0]`` with
  respect to ``args[argnum]``."""
  with jax.enable_x64(True):
    args = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]

    def loss(x):
      return reference(jnp, *args[:argnum], x, *args[argnum + 1 :], **kwargs)[0]

    return np.asarray(jax.grad(loss)(args[argnum]))


# Policy gradient (TRL's GRPOTrainer).


def pg_reference(
  xp,
  log_probs,
  old,
  advantages,
  mask,
  ref,
  *,
  loss_type,
  sampling,
  epsilon_low,
  epsilon_high,
  beta,
  max_length=None,
):
  """``(loss, metrics)``; metrics as numpy floats when ``xp`` is numpy."""
  batch, length = log_probs.shape
  tokens = xp.maximum(mask.sum(axis=-1), 1)  # [B]
  diff = xp.where(mask, log_probs - old, 0.0)
  if sampling == "sequence":
    ratio = xp.exp(diff.sum(axis=-1) / tokens)[:, None] * xp.ones((1, length))
  else:
    ratio = xp.exp(diff)
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
  adv = adv * xp.ones((1, length))
  surrogate = xp.minimum(
    ratio * adv, xp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
  )
  token_loss = -surrogate
  if beta > 0:
    kl = xp.exp(ref - log_probs) - (ref - log_probs) - 1
    token_loss = token_loss + beta * kl
  token_loss = xp.where(mask, token_loss, 0.0)
  all_tokens = xp.maximum(mask.sum(), 1)
  if loss_type == "grpo":
    loss = (token_loss.sum(axis=-1) / tokens).mean()
  elif loss_type in ("bnpo", "dapo"):
    loss = token_loss.sum() / all_tokens
  else:
    loss = token_loss.sum() / (batch * (max_length or length))
  if xp is not np:
    return loss, None

  def masked_mean(x):
    return float(np.where(mask, x, 0.0).sum() / all_tokens)

  metrics = {
    "clip_fraction_low": masked_mean((ratio < 1 - epsilon_low) & (adv < 0)),
    "clip_fraction_high": masked_mean((ratio > 1 + epsilon_high) & (adv > 0)),
  }
  if beta > 0:
    metrics["kl"] = masked_mean(kl)
  return float(loss), metrics


def _pg_problem(rng, advantages_shape):
  """float64 ``(log_probs, old, advantages, mask, ref)``: ratios spread past
  the clip on both sides, a mask with one sequence wholly dropped."""
  log_probs = -rng.exponential(1.0, (B, T))
  old = log_probs + rng.normal(0.0, 0.3, (B, T))
  ref = log_probs + rng.normal(0.0, 0.5, (B, T))
  advantages = rng.normal(0.0, 1.0, (B,) if advantages_shape == "[B]" else (B, T))
  mask = rng.random((B, T)) < 0.7
  mask[rng.integers(B)] = False
  return log_probs, old, advantages, mask, ref


# Every loss type, ratio and advantage shape, with and without the KL term, in
# float32; bfloat16 inputs for each loss type and ratio.
PG_LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]
PG_CASES = [
  *itertools.product(
    PG_LOSS_TYPES, ["token", "sequence"], ["[B]", "[B, T]"], [0.0, 0.04], ["float32"]
  ),
  *itertools.product(
    PG_LOSS_TYPES, ["token", "sequence"], ["[B, T]"], [0.04], ["bfloat16"]
  ),
]


@pytest.mark.parametrize("loss_type, sampling, advantages_shape, beta, dtype", PG_CASES)
def test_policy_gradient_matches_the_reference(
  rng, loss_type, sampling, advantages_shape, beta, dtype
):
  log_probs, old, advantages, mask, ref = _pg_problem(rng, advantages_shape)
  lp_x, old_x, adv_x, ref_x = _cast(dtype, log_probs, old, advantages, ref)
  options = dict(
    loss_type=loss_type,
    importance_sampling=sampling,
    epsilon_low=0.2,
    epsilon_high=0.28,
    beta=beta,
    max_length=T + 3 if loss_type == "dr_grpo" else None,
  )
  ref_arg = ref_x if beta > 0 else None

  def loss_of(lp, old, adv, ref):
    return losses.policy_gradient_loss(lp, old, adv, mask, ref_log_probs=ref, **options)

  (loss, metrics), grad = _value_and_grad(loss_of)(lp_x, old_x, adv_x, ref_arg)
  inputs64 = [to64(x) for x in (lp_x, old_x, adv_x)] + [mask, to64(ref_x)]
  options64 = {k: v for k, v in options.items() if k != "importance_sampling"}
  options64["sampling"] = sampling
  expected, expected_metrics = pg_reference(np, *inputs64, **options64)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(
    float(loss), expected, rtol=LOSS_TOL[dtype], atol=LOSS_TOL[dtype]
  )
  _assert_metrics_close(metrics, expected_metrics, dtype)
  _assert_grad_close(grad, _grad64(pg_reference, 0, *inputs64, **options64), dtype)
  assert np.all(to64(grad)[~mask] == 0)


def test_policy_gradient_default_clip_is_symmetric_and_metrics_are_trls(rng):
  # Per-token advantages: both signs in every sequence.
  log_probs, old, advantages, mask, _ = _pg_problem(rng, "[B, T]")
  loss, metrics = losses.policy_gradient_loss(log_probs, old, advantages, mask)
  expected, expected_metrics = pg_reference(
    np,
    *(to64(jnp.asarray(x, jnp.float32)) for x in (log_probs, old, advantages)),
    mask,
    None,
    loss_type="grpo",
    sampling="token",
    epsilon_low=0.2,
    epsilon_high=0.2,
    beta=0.0,
  )
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-5)
  _assert_metrics_close(metrics, expected_metrics, "float32")
  # The problem spreads the ratios past both ends of the clip.
  assert metrics["clip_fraction_low"] > 0 and metrics["clip_fraction_high"] > 0


@pytest.mark.parametrize("sampling", ["token", "sequence"])
def test_policy_gradient_ignores_dropped_tokens_and_differentiates_the_policy_only(
  rng, sampling
):
  log_probs, old, advantages, mask, ref = _pg_problem(rng, "[B, T]")
  options = dict(loss_type="dapo", importance_sampling=sampling, beta=0.1)

  run = _value_and_grad(
    lambda *a: losses.policy_gradient_loss(
      a[0], a[1], a[2], mask, ref_log_probs=a[3], **options
    ),
    (0, 1, 2, 3),
  )

  arrays = _cast("float32", log_probs, old, advantages, ref)
  (loss, metrics), grads = run(*arrays)
  # Values at dropped tokens do not matter, NaN and inf included.
  junk_values = [jnp.nan, -jnp.inf, jnp.nan, 50.0]
  junk = [jnp.where(mask, x, v) for x, v in zip(arrays, junk_values, strict=True)]
  (junk_loss, junk_metrics), junk_grads = run(*junk)
  assert float(junk_loss) == float(loss)
  assert {k: float(v) for k, v in junk_metrics.items()} == {
    k: float(v) for k, v in metrics.items()
  }
  np.testing.assert_array_equal(junk_grads[0], grads[0])
  assert np.any(np.asarray(grads[0]) != 0)
  # old_log_probs, advantages and ref_log_probs are constants.
  for grad in (*grads[1:], *junk_grads[1:]):
    assert not np.any(np.asarray(grad))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_policy_gradient_with_no_kept_token_is_zero(rng, loss_type):
  log_probs, old, advantages, _, ref = _pg_problem(rng, "[B]")
  mask = np.zeros((B, T), np.int32)  # integer masks are taken too

  def loss_of(lp):
    return losses.policy_gradient_loss(
      lp, old, advantages, mask, ref_log_probs=ref, beta=0.1, loss_type=loss_type
    )

  (loss, metrics), grad = _value_and_grad(loss_of)(jnp.asarray(log_probs, jnp.float32))
  assert float(loss) == 0.0
  assert {k: float(v) for k, v in metrics.items()} == {
    "clip_fraction_low": 0.0,
    "clip_fraction_high": 0.0,
    "kl": 0.0,
  }
  assert not np.any(np.asarray(grad))


# Preference losses (TRL's DPOTrainer, Liger's SimPO and ORPO).


def _log_sigmoid(xp, z):
  return -xp.logaddexp(0.0, -z)


def _reward_metrics(chosen, rejected):
  return {
    "chosen_rewards": chosen.mean(),
    "rejected_rewards": rejected.mean(),
    "reward_accuracy": (chosen > rejected).mean(),
    "reward_margin": (chosen - rejected).mean(),
  }


def dpo_reference(
  xp, chosen, rejected, ref_chosen, ref_rejected, *, beta, loss_type, label_smoothing
):
  h = (chosen - rejected) - (ref_chosen - ref_rejected)
  if loss_type == "sigmoid":
    losses_ = -(1 - label_smoothing) * _log_sigmoid(xp, beta * h)
    losses_ = losses_ - label_smoothing * _log_sigmoid(xp, -beta * h)
  elif loss_type == "ipo":
    losses_ = (h - 1 / (2 * beta)) ** 2
  else:
    losses_ = xp.maximum(0.0, 1 - beta * h)
  if xp is not np:
    return losses_.mean(), None
  rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
  return float(losses_.mean()), _reward_metrics(*rewards)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
  "loss_type, label_smoothing",
  [("sigmoid", 0.0), ("sigmoid", 0.15), ("ipo", 0.0), ("hinge", 0.0)],
)
def test_dpo_matches_the_reference(rng, loss_type, label_smoothing, dtype):
  # Summed log-probs of responses of 20-60 tokens; the reference near them.
  chosen, rejected = -rng.uniform(20, 60, B), -rng.uniform(20, 60, B)
  ref_chosen = chosen + rng.normal(0.0, 3.0, B)
  ref_rejected = rejected + rng.normal(0.0, 3.0, B)
  rejected[0], ref_rejected[0] = chosen[0], ref_chosen[0]  # a tie: not accurate
  arrays = _cast(dtype, chosen, rejected, ref_chosen, ref_rejected)
  options = dict(beta=0.1, loss_type=loss_type, label_smoothing=label_smoothing)

  def loss_of(*arrays):
    return losses.dpo_loss(*arrays, **options)

  (loss, metrics), grads = _value_and_grad(loss_of, (0, 1, 2, 3))(*arrays)
  inputs64 = [to64(x) for x in arrays]
  expected, expected_metrics = dpo_reference(np, *inputs64, **options)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(
    float(loss), expected, rtol=LOSS_TOL[dtype], atol=LOSS_TOL[dtype]
  )
  _assert_metrics_close(metrics, expected_metrics, dtype)
  for argnum, grad in enumerate(grads[:2]):
    expected_grad = _grad64(dpo_reference, argnum, *inputs64, **options)
    _assert_grad_close(grad, expected_grad, dtype)
  # The reference's log-probs are constants.
  assert not np.any(np.asarray(grads[2])) and not np.any(np.asarray(grads[3]))


def simpo_reference(xp, chosen, rejected, *, beta, gamma, label_smoothing):
  z = beta * (chosen - rejected) - gamma
  losses_ = -(1 - label_smoothing) * _log_sigmoid(xp, z)
  losses_ = losses_ - label_smoothing * _log_sigmoid(xp, -z)
  if xp is not np:
    return losses_.mean(), None
  return float(losses_.mean()), _reward_metrics(beta * chosen, beta * rejected)


def orpo_reference(xp, chosen, rejected, *, beta):
  def log_odds(p):
    return p - xp.log1p(-xp.exp(p))

  log_odds_ratio = log_odds(chosen) - log_odds(rejected)
  log_sig = _log_sigmoid(xp, log_odds_ratio)
  if xp is not np:
    return -beta * log_sig.mean(), None
  metrics = _reward_metrics(beta * chosen, beta * rejected)
  metrics.update(log_odds_ratio=log_sig.mean(), log_odds_chosen=log_odds_ratio.mean())
  return float(-beta * log_sig.mean()), metrics


def _mean_log_probs(rng, n):
  """Per-token means in (-3, 0), a third within 1e-3 of 0 (probabilities near
  1, where ``log(1 - exp(p))`` loses float32 digits unless written with care)."""
  means = -rng.uniform(0.05, 3.0, n)
  near_one = rng.random(n) < 0.3
  return np.where(near_one, -rng.uniform(1e-5, 1e-3, n), means)


PREFERENCE_CASES = {
  "simpo_defaults": (losses.simpo_loss, simpo_reference, {}),
  "simpo": (
    losses.simpo_loss,
    simpo_reference,
    dict(beta=2.5, gamma=1.2, label_smoothing=0.1),
  ),
  "orpo_default": (losses.orpo_loss, orpo_reference, {}),
  "orpo": (losses.orpo_loss, orpo_reference, dict(beta=0.25)),
}
_DEFAULTS = {
  "simpo_defaults": dict(beta=0.1, gamma=0.5, label_smoothing=0.0),  # Liger's
  "orpo_default": dict(beta=0.1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFERENCE_CASES))
def test_simpo_and_orpo_match_the_reference(rng, case, dtype):
  fn, reference, options = PREFERENCE_CASES[case]
  n = 3 * B  # more pairs, so that the accuracy is not all or nothing
  chosen, rejected = _mean_log_probs(rng, n), _mean_log_probs(rng, n)
  rejected[0] = chosen[0]  # a tie is not a correct ranking
  chosen, rejected = _cast(dtype, chosen, rejected)
  (loss, metrics), grads = _value_and_grad(lambda c, r: fn(c, r, **options), (0, 1))(
    chosen, rejected
  )
  options64 = options or _DEFAULTS[case]
  inputs64 = [to64(chosen), to64(rejected)]
  expected, expected_metrics = reference(np, *inputs64, **options64)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(
    float(loss), expected, rtol=LOSS_TOL[dtype], atol=LOSS_TOL[dtype]
  )
  _assert_metrics_close(metrics, expected_metrics, dtype)
  for argnum, grad in enumerate(grads):
    _assert_grad_close(grad, _grad64(reference, argnum, *inputs64, **options64), dtype)


# Top-k distillation.


def top_k_reference(xp, student, teacher, where):
  probs = xp.exp(teacher)
  safe = xp.where(probs > 0, teacher - student, 0.0)  # an unused slot: -inf
  per_token = (probs * safe).sum(axis=-1)
  kept = xp.maximum(where.sum(), 1)
  loss = xp.where(where, per_token, 0.0).sum() / kept
  if xp is not np:
    return loss, None
  mass = float(np.where(where, probs.sum(axis=-1), 0.0).sum() / kept)
  return float(loss), {"teacher_mass": mass}


def _top_k_problem(rng, shape):
  """Log-probs of K of 3K ids under random distributions, the teacher's with
  a few unused slots (-inf)."""

  def log_probs(scale):
    logits = rng.normal(0.0, scale, (*shape, 3 * K))
    logits -= logits.max(axis=-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True)))[..., :K]

  teacher = log_probs(3.0)
  teacher[rng.random(teacher.shape) < 0.05] = -np.inf
  return log_probs(2.0), teacher


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["random", "none", "nothing kept"])
def test_top_k_distillation_matches_the_reference(rng, where, dtype):
  shape = (B, T)
  student, teacher = _top_k_problem(rng, shape)
  keep = {
    "random": rng.random(shape) < 0.6,
    "none": None,
    "nothing kept": np.zeros(shape, bool),
  }[where]
  student_x, teacher_x = _cast(dtype, student, teacher)
  (loss, metrics), (grad, teacher_grad) = _value_and_grad(
    lambda s, t: losses.top_k_distillation_loss(s, t, where=keep), (0, 1)
  )(student_x, teacher_x)
  keep64 = np.ones(shape, bool) if keep is None else keep
  inputs64 = [to64(student_x), to64(teacher_x), keep64]
  expected, expected_metrics = top_k_reference(np, *inputs64)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(
    float(loss), expected, rtol=LOSS_TOL[dtype], atol=LOSS_TOL[dtype]
  )
  _assert_metrics_close(metrics, expected_metrics, dtype)
  if where == "nothing kept":
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))
  else:
    _assert_grad_close(grad, _grad64(top_k_reference, 0, *inputs64), dtype)
  assert not np.any(np.asarray(teacher_grad))


# Argument checks.

_LP = np.zeros((B, T), np.float32)
_MASK = np.ones((B, T), bool)
_SEQ = np.zeros(B, np.float32)


def _pg(**changes):
  args = dict(log_probs=_LP, old_log_probs=_LP, advantages=_SEQ, mask=_MASK)
  args.update(changes)
  return lambda: losses.policy_gradient_loss(**args)


def _dpo(*arrays, **options):
  arrays = arrays or (_SEQ,) * 4
  return lambda: losses.dpo_loss(*arrays, **options)


ERRORS = {
  "pg_loss_type": (
    _pg(loss_type="ppo"),
    ValueError,
    "loss_type must be one of ('grpo', 'bnpo', 'dapo', 'dr_grpo'), got 'ppo'",
  ),
  "pg_sampling": (
    _pg(importance_sampling="seq"),
    ValueError,
    "importance_sampling must be one of ('token', 'sequence'), got 'seq'",
  ),
  "pg_rank": (
    _pg(log_probs=_LP[0]),
    ValueError,
    "log_probs must be [B, T], got shape (37,)",
  ),
  "pg_old_shape": (
    _pg(old_log_probs=_LP[:, 1:]),
    ValueError,
    "old_log_probs must have log_probs's shape (5, 37), got (5, 36)",
  ),
  "pg_advantages_shape": (
    _pg(advantages=_SEQ[:, None]),
    ValueError,
    "advantages must be [B] (5,) or [B, T] (5, 37) (log_probs'), got (5, 1)",
  ),
  "pg_mask_shape": (
    _pg(mask=_MASK[:4]),
    ValueError,
    "mask must have shape (5, 37), got (4, 37)",
  ),
  "pg_mask_dtype": (
    _pg(mask=_LP),
    TypeError,
    "mask must be bool or integer (nonzero keeps a token), got float32",
  ),
  "pg_int_log_probs": (
    _pg(log_probs=_MASK.astype(np.int32)),
    TypeError,
    "log_probs must have a floating dtype, got int32",
  ),
  "pg_beta_without_ref": (_pg(beta=0.04), ValueError, "beta > 0 needs ref_log_probs"),
  "pg_ref_without_beta": (
    _pg(ref_log_probs=_LP),
    ValueError,
    "ref_log_probs is used only for the KL penalty",
  ),
  "pg_ref_shape": (
    _pg(ref_log_probs=_LP.T, beta=0.1),
    ValueError,
    "ref_log_probs must have log_probs's shape (5, 37), got (37, 5)",
  ),
  "pg_negative_epsilon": (
    _pg(epsilon_high=-0.1),
    ValueError,
    "epsilon_high must be >= 0",
  ),
  "pg_negative_beta": (_pg(beta=-1.0), ValueError, "beta must be >= 0"),
  "pg_max_length_for_grpo": (
    _pg(max_length=64),
    ValueError,
    "max_length is dr_grpo's normaliser; loss_type='grpo' does not use it",
  ),
  "pg_max_length_short": (
    _pg(loss_type="dr_grpo", max_length=16),
    ValueError,
    "max_length must be >= 37, got 16",
  ),
  "dpo_loss_type": (
    _dpo(loss_type="kto"),
    ValueError,
    "loss_type must be one of ('sigmoid', 'ipo', 'hinge'), got 'kto'",
  ),
  "dpo_smoothing_ipo": (
    _dpo(loss_type="ipo", label_smoothing=0.1),
    ValueError,
    "label_smoothing applies to loss_type='sigmoid' only, not 'ipo'",
  ),
  "dpo_smoothing_range": (
    _dpo(label_smoothing=0.7),
    ValueError,
    "label_smoothing must be in [0, 0.5]",
  ),
  "dpo_beta": (_dpo(beta=0.0), ValueError, "beta must be > 0, got 0.0"),
  "dpo_shape": (
    _dpo(_SEQ, _SEQ, _SEQ[:4], _SEQ),
    ValueError,
    "ref_chosen_log_probs must have chosen_log_probs's shape (5,), got (4,)",
  ),
  "dpo_rank": (
    _dpo(*(_LP,) * 4),
    ValueError,
    "chosen_log_probs must be [B], got shape (5, 37)",
  ),
  "simpo_beta": (
    lambda: losses.simpo_loss(_SEQ, _SEQ, beta=-1.0),
    ValueError,
    "beta must be > 0",
  ),
  "simpo_shape": (
    lambda: losses.simpo_loss(_SEQ, _SEQ[1:]),
    ValueError,
    "rejected_log_probs must have chosen_log_probs's shape (5,), got (4,)",
  ),
  "orpo_dtype": (
    lambda: losses.orpo_loss(_SEQ, np.zeros(B, np.int32)),
    TypeError,
    "rejected_log_probs must have a floating dtype, got int32",
  ),
  "top_k_shape": (
    lambda: losses.top_k_distillation_loss(np.zeros((B, K)), np.zeros((B, K + 1))),
    ValueError,
    "teacher_log_probs must have student_log_probs's shape (5, 7), got (5, 8)",
  ),
  "top_k_where": (
    lambda: losses.top_k_distillation_loss(
      np.zeros((B, K), np.float32), np.zeros((B, K), np.float32), where=_MASK
    ),
    ValueError,
    "where must have shape (5,), got (5, 37)",
  ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_arguments_raise_clear_errors(case):
  call, error, message = ERRORS[case]
  with pytest.raises(error, match=re.escape(message)):
    call()


def test_the_module_is_public():
  import mst_jax

  assert mst_jax.losses is losses
  assert "losses" in dir(mst_jax)
