"""Values that must hold exactly: divergences are never negative, and float64
inputs keep float64 class weights (checked against tests/oracle.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

import mst_jax

DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_divergence_of_equal_heads_is_zero_not_negative(rng, impl, divergence):
  """P = Q: every sum that should cancel rounds to either side of 0; the
  loss is clamped to 0, per token and reduced."""
  n, dim, vocab = 29, 24, 301
  hidden = jnp.asarray(rng.standard_normal((n, dim)), jnp.float32)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.4, jnp.float32)
  for reduction in ("none", "mean", "sum"):
    loss = mst_jax.linear_distillation_loss(
      hidden,
      weight,
      hidden,
      weight,
      divergence=divergence,
      impl=impl,
      reduction=reduction,
      chunk_size=None if impl == "reference" else 8,
    )
    assert np.all(np.asarray(loss) >= 0.0), (reduction, np.asarray(loss).min())
    assert np.all(np.asarray(loss) < 1e-5)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_float64_class_weights_are_not_rounded(rng, impl, label_smoothing):
  """float64 inputs: the loss and gradients match the float64 oracle to
  float64 precision, with class weights whose float32 rounding would show."""
  n, dim, vocab = 23, 7, 37
  with jax.enable_x64(True):
    hidden = jnp.asarray(rng.standard_normal((n, dim)))
    weight = jnp.asarray(rng.standard_normal((vocab, dim)))
    labels = jnp.asarray(rng.integers(0, vocab, n))
    class_weights = jnp.asarray(rng.random(vocab) + 1e-3)
    where = jnp.asarray(rng.random(n) > 0.3)
    kwargs = dict(
      class_weights=class_weights, where=where, label_smoothing=label_smoothing
    )

    def loss(fn, **extra):
      return lambda h, w: fn(h, w, labels, **kwargs, **extra)

    got, got_grads = jax.value_and_grad(
      loss(mst_jax.linear_cross_entropy, impl=impl), argnums=(0, 1)
    )(hidden, weight)
    want, want_grads = jax.value_and_grad(loss(oracle.cross_entropy), argnums=(0, 1))(
      hidden, weight
    )
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-13)
    for g, w in zip(got_grads, want_grads, strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_a_mean_whose_counted_labels_all_weigh_zero_is_zero(rng, impl):
  """Dividing by a zero sum of label weights gives 0.0, with zero
  gradients, as for token weights."""
  n, dim, vocab = 19, 8, 41
  hidden = jnp.asarray(rng.standard_normal((n, dim)), jnp.float32)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, vocab // 2, n))
  class_weights = jnp.asarray(np.r_[np.zeros(vocab // 2), np.ones(vocab - vocab // 2)])
  value, grads = jax.value_and_grad(
    lambda h, w: mst_jax.linear_cross_entropy(
      h, w, labels, class_weights=class_weights, impl=impl
    ),
    argnums=(0, 1),
  )(hidden, weight)
  assert float(value) == 0.0
  for g in grads:
    assert not np.any(np.asarray(g))
