"""The reference itself, against a token-by-token numpy float64 definition.

The chunked suite trusts ``mst_jax.reference`` as its oracle; this file checks
the reference's semantics (options, masks, shift, reductions, aux) against an
independent numpy loop, so the oracle is not taken on faith.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_problem, to64

import mst_jax


def _numpy_per_token(
  hidden,
  weight,
  labels,
  bias,
  where,
  *,
  ignore_index=-100,
  label_smoothing=0.0,
  z_loss=0.0,
  logit_softcap=None,
  shift=False,
):
  """Per-token loss, lse and correctness, one token at a time, float64."""
  hidden, weight = to64(hidden), to64(weight)
  bias = np.zeros(weight.shape[0]) if bias is None else to64(bias)
  labels = np.asarray(labels)
  where = np.ones(labels.shape, bool) if where is None else np.asarray(where)
  seq = labels.shape[-1]
  loss, lse, correct = (np.zeros(labels.shape) for _ in range(3))
  for index in np.ndindex(labels.shape):
    if shift:
      if index[-1] == seq - 1:
        continue
      target_index = index[:-1] + (index[-1] + 1,)
    else:
      target_index = index
    label = labels[target_index]
    if label == ignore_index or not where[target_index]:
      continue
    z = weight @ hidden[index] + bias
    if logit_softcap is not None:
      z = logit_softcap * np.tanh(z / logit_softcap)
    m = z.max()
    lse[index] = m + np.log(np.exp(z - m).sum())
    log_p = z - lse[index]
    if not 0 <= label < z.size:
      loss[index] = np.nan
      continue
    loss[index] = (
      -(1 - label_smoothing) * log_p[label]
      - label_smoothing * log_p.mean()
      + z_loss * lse[index] ** 2
    )
    correct[index] = np.argmax(z) == label
  return loss, lse, correct.astype(bool)


CASES = {
  "plain": {},
  "smoothing": dict(label_smoothing=0.3),
  "z_loss": dict(z_loss=0.01),
  "softcap": dict(logit_softcap=3.0),
  "shift": dict(shift=True),
  "ignore_index": dict(ignore_index=5),
  "all": dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0, shift=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_numpy_definition(rng, case):
  options = CASES[case]
  problem = make_problem(
    rng,
    (3, 7),
    dim=6,
    vocab=53,
    bias=True,
    mask="prefix",
    ignore_index=options.get("ignore_index", -100),
  )
  problem.where = np.asarray(rng.random((3, 7)) > 0.25)
  loss, lse, correct = _numpy_per_token(*problem.args, problem.where, **options)
  valid_count = int(np.sum(lse != 0))
  with jax.enable_x64(True):
    args = (
      to64(problem.hidden),
      to64(problem.weight),
      problem.labels,
      to64(problem.bias),
    )
    per_token, aux = mst_jax.reference.linear_cross_entropy(
      *args, where=problem.where, reduction="none", return_aux=True, **options
    )
    total = mst_jax.reference.linear_cross_entropy(
      *args, where=problem.where, reduction="sum", **options
    )
    mean = mst_jax.reference.linear_cross_entropy(
      *args, where=problem.where, reduction="mean", **options
    )
  np.testing.assert_allclose(per_token, loss, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(aux.lse, lse, rtol=1e-12, atol=1e-12)
  assert int(aux.n_valid) == valid_count
  assert int(aux.n_correct) == int(correct.sum())
  np.testing.assert_allclose(total, loss.sum(), rtol=1e-12)
  np.testing.assert_allclose(mean, loss.sum() / valid_count, rtol=1e-12)
  z = options.get("z_loss", 0.0)
  np.testing.assert_allclose(aux.z_loss, z * lse**2, rtol=1e-12)  # per token


def test_reference_out_of_range_label_is_nan(rng):
  problem = make_problem(rng, (9,), dim=4, vocab=11, mask="none")
  labels = np.asarray(problem.labels).copy()
  labels[[2, 5]] = [11, -3]
  per_token = mst_jax.reference.linear_cross_entropy(
    problem.hidden, problem.weight, labels, reduction="none"
  )
  np.testing.assert_array_equal(np.flatnonzero(np.isnan(per_token)), [2, 5])


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_nan_rules_hold_for_the_reference_too(rng, impl):
  """docs/errors.md's rules: a NaN hidden row at an excluded token changes
  nothing; a valid token's out-of-range label makes its loss and its
  gradients NaN. The oracle follows them like the chunked paths."""
  problem = make_problem(rng, (6,), dim=8, vocab=13, mask="none")
  hidden = problem.hidden.at[1].set(jnp.nan)
  labels = problem.labels.at[4].set(13)

  def grads(where):
    def total(hidden, weight):
      out = mst_jax.linear_cross_entropy(
        hidden, weight, labels, where=where, reduction="none", impl=impl
      )
      return jnp.sum(out), out

    (_, per_token), (dh, dw) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
      hidden, problem.weight
    )
    return np.asarray(per_token), np.asarray(dh), np.asarray(dw)

  per_token, dh, dw = grads(jnp.arange(6) != 1)
  assert np.isnan(per_token[4]) and per_token[1] == 0.0
  assert np.isnan(dh[4]).all() and np.isfinite(np.delete(dh, 4, 0)).all()
  assert np.isnan(dw).any()  # the bad row reaches the weight
  per_token, dh, dw = grads((jnp.arange(6) != 1) & (jnp.arange(6) != 4))
  assert np.isfinite(per_token).all() and np.isfinite(dh).all()
  assert np.isfinite(dw).all() and (dh[[1, 4]] == 0).all()
