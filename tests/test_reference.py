"""The oracle and the library's reference, against independent definitions.

The tests trust tests/oracle.py as their float64 oracle; this file checks it
against a token-by-token numpy loop (options, masks, shift, token and class
weights, reductions), so the oracle is not taken on faith. Then
``mst_jax.reference`` (``impl="reference"``, a public feature) is checked
against the oracle at float64, values and gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
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
  token_weights=None,
  class_weights=None,
  ignore_index=-100,
  label_smoothing=0.0,
  z_loss=0.0,
  logit_softcap=None,
  logit_scale=None,
  shift=False,
):
  """Per-token loss, lse, correctness and the mean's denominator term, one
  token at a time, float64 (torch's class-weighted form)."""
  hidden, weight = to64(hidden), to64(weight)
  bias = np.zeros(weight.shape[0]) if bias is None else to64(bias)
  labels = np.asarray(labels)
  where = np.ones(labels.shape, bool) if where is None else np.asarray(where)
  vocab = weight.shape[0]
  w = np.ones(vocab) if class_weights is None else np.asarray(class_weights)
  seq = labels.shape[-1]
  loss, lse, correct, denominator = (np.zeros(labels.shape) for _ in range(4))
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
    z = (weight @ hidden[index] + bias) * (logit_scale or 1.0)
    if logit_softcap is not None:
      z = logit_softcap * np.tanh(z / logit_softcap)
    m = z.max()
    lse[index] = m + np.log(np.exp(z - m).sum())
    if not 0 <= label < vocab:
      loss[index] = np.nan
      continue
    eps = label_smoothing
    loss[index] = (
      (1 - eps) * w[label] * (lse[index] - z[label])
      + eps / vocab * np.sum(w * (lse[index] - z))
      + z_loss * lse[index] ** 2
    )
    token_weight = 1.0 if token_weights is None else token_weights[target_index]
    loss[index] *= token_weight
    denominator[index] = token_weight * w[label]
    correct[index] = np.argmax(z) == label
  return loss, lse, correct.astype(bool), denominator


CASES = {
  "plain": {},
  "smoothing": dict(label_smoothing=0.3),
  "z_loss": dict(z_loss=0.01),
  "softcap": dict(logit_softcap=3.0),
  "scale": dict(logit_scale=0.7),
  "shift": dict(shift=True),
  "ignore_index": dict(ignore_index=5),
  "token_weights": dict(token_weights=True, shift=True),
  "class_weights": dict(class_weights=True, label_smoothing=0.2, z_loss=1e-3),
  "all": dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=5.0, shift=True),
}


def _case(rng, case, shape=(3, 7), vocab=53):
  """A problem and the options of ``CASES[case]``, weights drawn."""
  options = dict(CASES[case])
  problem = make_problem(
    rng,
    shape,
    dim=6,
    vocab=vocab,
    bias=True,
    mask="prefix",
    ignore_index=options.get("ignore_index", -100),
  )
  problem.where = np.asarray(rng.random(shape) > 0.25)
  if options.get("token_weights"):
    options["token_weights"] = rng.random(shape) * 2.0
  if options.get("class_weights"):
    weights = rng.random(vocab) * 2.0
    weights[rng.integers(0, vocab, 4)] = 0.0
    options["class_weights"] = weights
  return problem, options


def _args64(problem):
  as64 = lambda x: None if x is None else jnp.asarray(to64(x))
  return as64(problem.hidden), as64(problem.weight), problem.labels, as64(problem.bias)


@pytest.mark.parametrize("case", list(CASES))
def test_the_oracle_matches_the_numpy_definition(rng, case):
  problem, options = _case(rng, case)
  loss, _, _, denominator = _numpy_per_token(*problem.args, problem.where, **options)
  with jax.enable_x64(True):
    program = _values_program(case)
    per_token, total, mean = program(*_args64(problem), problem.where, _arrays(options))
  np.testing.assert_allclose(per_token, loss, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(total, loss.sum(), rtol=1e-12)
  np.testing.assert_allclose(mean, loss.sum() / denominator.sum(), rtol=1e-12)


def _arrays(options):
  return {k: v for k, v in options.items() if isinstance(v, np.ndarray)}


@functools.cache
def _values_program(case):
  """The oracle's loss for each reduction, for ``CASES[case]``."""

  def values(hidden, weight, labels, bias, where, arrays):
    options = {k: v for k, v in CASES[case].items() if k not in arrays}
    return [
      oracle64.cross_entropy(
        hidden, weight, labels, bias, where=where, reduction=r, **options, **arrays
      )
      for r in ("none", "sum", "mean")
    ]

  return jax.jit(values)


@functools.cache
def _loss_program(fn, case, reduction):
  """``fn``'s loss (per token: a weighted sum) and its gradients for
  ``CASES[case]`` and ``reduction``, one compiled program for every seed."""

  def loss(hidden, weight, labels, bias, where, arrays):
    options = {k: v for k, v in CASES[case].items() if k not in arrays}
    out = fn(
      hidden,
      weight,
      labels,
      bias,
      where=where,
      reduction=reduction,
      **options,
      **arrays,
    )
    return jnp.sum(out * jnp.arange(1.0, out.size + 1).reshape(out.shape))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3)))


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_the_oracle_log_probs_match_the_numpy_definition(rng, layout):
  problem, _ = _case(rng, "plain")
  options = dict(logit_scale=0.7, logit_softcap=4.0, shift=True)
  loss, lse, _, _ = _numpy_per_token(*problem.args, problem.where, **options)
  logits = to64(problem.hidden) @ to64(problem.weight).T + to64(problem.bias)
  scores = 4.0 * np.tanh(0.7 * logits / 4.0)
  log_p = scores - lse[..., None]
  entropy = np.where(lse != 0, -np.sum(np.exp(log_p) * log_p, axis=-1), 0.0)
  with jax.enable_x64(True):
    weight = to64(problem.weight) if layout == "vd" else to64(problem.weight).T
    log_probs = jax.jit(
      functools.partial(
        oracle64.log_probs,
        where=problem.where,
        weight_layout=layout,
        return_entropy=True,
        **options,
      )
    )
    got, got_entropy = log_probs(
      to64(problem.hidden), weight, problem.labels, to64(problem.bias)
    )
  np.testing.assert_allclose(got, -loss, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got_entropy, entropy, rtol=1e-12, atol=1e-12)


def test_the_oracle_takes_both_layouts_and_any_float_dtype(rng):
  problem, options = _case(rng, "all")
  with jax.enable_x64(True):
    hidden, weight, labels, bias = _args64(problem)
    kwargs = dict(where=problem.where, reduction="none", **options)
    cross_entropy, transposed = (
      jax.jit(functools.partial(oracle64.cross_entropy, weight_layout=layout, **kwargs))
      for layout in ("vd", "dv")
    )
    want = cross_entropy(hidden, weight, labels, bias)
    got = transposed(hidden, weight.T, labels, bias)
    np.testing.assert_array_equal(got, want)
    as_float32 = cross_entropy(*problem.args)
    assert as_float32.dtype == want.dtype == jnp.float64
    np.testing.assert_array_equal(as_float32, want)
  with pytest.raises(AssertionError, match="enable_x64"):
    oracle64.cross_entropy(*problem.args)


def test_the_oracles_masked_edges(rng):
  """Every token masked: a mean of exactly 0; a valid out-of-range label:
  NaN loss and gradients; a NaN hidden row or weight where a token is
  excluded: no effect, gradients included."""
  problem = make_problem(rng, (6,), dim=8, vocab=13, mask="none")
  with jax.enable_x64(True):
    hidden, weight, labels, _ = _args64(problem)
    cross_entropy = jax.jit(oracle64.cross_entropy)
    assert cross_entropy(hidden, weight, labels, where=np.zeros(6, bool)) == 0
    assert cross_entropy(hidden, weight, labels, token_weights=np.zeros(6)) == 0
    bad = labels.at[4].set(13)
    where = np.arange(6) != 1
    poisoned = hidden.at[1].set(jnp.nan)

    def grads(hidden, where, token_weights=None):
      def total(hidden, weight):
        out = oracle64.cross_entropy(
          hidden,
          weight,
          bad,
          where=where,
          token_weights=token_weights,
          reduction="none",
        )
        return jnp.sum(out), out

      fn = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))
      (_, per_token), (dh, dw) = fn(hidden, weight)
      return np.asarray(per_token), np.asarray(dh), np.asarray(dw)

    per_token, dh, dw = grads(poisoned, where)
    assert np.isnan(per_token[4]) and per_token[1] == 0.0
    assert np.isnan(dh[4]).all() and np.isfinite(np.delete(dh, 4, 0)).all()
    token_weights = np.where(where, 1.0, np.nan)
    per_token, dh, dw = grads(poisoned, where & (np.arange(6) != 4), token_weights)
    assert np.isfinite(per_token).all() and np.isfinite(dh).all()
    assert np.isfinite(dw).all() and (dh[[1, 4]] == 0).all()


@pytest.mark.parametrize("case", list(CASES))
def test_the_reference_matches_the_oracle(rng, case):
  """``impl="reference"`` at float64: per-token, summed and mean losses
  and their gradients, and the aux values, against the oracle (the class
  weights float64 too)."""
  problem, options = _case(rng, case)
  _, lse, correct, _ = _numpy_per_token(*problem.args, problem.where, **options)

  with jax.enable_x64(True):
    args = (*_args64(problem), problem.where, _arrays(options))
    for reduction in ("none", "sum", "mean"):
      got, want = (
        _loss_program(fn, case, reduction)(*args)
        for fn in (mst_jax.reference.linear_cross_entropy, oracle64.cross_entropy)
      )
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=reduction)
    args = _args64(problem)
    _, aux = mst_jax.reference.linear_cross_entropy(
      *args, where=problem.where, reduction="none", return_aux=True, **options
    )
  np.testing.assert_allclose(aux.lse, lse, rtol=1e-12, atol=1e-12)
  assert int(aux.n_valid) == int(np.sum(lse != 0))
  assert int(aux.n_correct) == int(correct.sum())
  tw = options.get("token_weights")
  z_loss = options.get("z_loss", 0.0) * lse**2
  if tw is not None:  # token weights at label positions
    shifted = np.concatenate([tw[..., 1:], 0 * tw[..., :1]], axis=-1)
    z_loss = z_loss * (shifted if options.get("shift") else tw)
  np.testing.assert_allclose(aux.z_loss, z_loss, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_the_reference_log_probs_match_the_oracle(rng, layout):
  problem, _ = _case(rng, "plain")
  options = dict(logit_scale=0.7, logit_softcap=4.0, shift=True, weight_layout=layout)
  g_lp, g_h = rng.standard_normal((2, *problem.labels.shape))
  with jax.enable_x64(True):
    hidden, weight, labels, bias = _args64(problem)
    weight = weight if layout == "vd" else weight.T

    def total(fn, hidden, weight, bias):
      lp, h = fn(
        hidden,
        weight,
        labels,
        bias,
        where=problem.where,
        return_entropy=True,
        **options,
      )
      return jnp.sum(lp * g_lp + h * g_h)

    got, want = (
      jax.jit(jax.value_and_grad(functools.partial(total, fn), argnums=(0, 1, 2)))(
        hidden, weight, bias
      )
      for fn in (mst_jax.reference.linear_log_probs, oracle64.log_probs)
    )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


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
  gradients NaN. The reference follows them like the chunked paths."""
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
