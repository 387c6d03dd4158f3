"""``logit_scale`` as an array (a temperature a position or a sequence),
traced under ``jit``, against the float64 oracle on logits scaled row by row:
values and gradients with respect to hidden, weight and the scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import to64

import mst_jax

# float32 math; bfloat16 inputs are also scaled in bfloat16 (one rounding of
# each hidden element) and return bfloat16 gradients. A dropped term errs by
# about 1.
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def _rel(out, ref):
  out, ref = to64(out), np.asarray(ref, np.float64)
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def _problem(rng, dtype):
  batch, dim, vocab = (3, 10), 24, 301
  hidden = jnp.asarray(rng.standard_normal((*batch, dim)), dtype)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) / np.sqrt(dim), dtype)
  labels = rng.integers(0, vocab, batch)
  labels[rng.random(batch) < 0.2] = -100
  return hidden, weight, jnp.asarray(labels)


def _scale(rng, shape):
  return jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_shape", [(3, 1), (3, 10)], ids=["sequence", "token"])
@pytest.mark.parametrize("function", ["cross_entropy", "log_probs"])
def test_scale_per_row_matches_the_oracle(rng, dtype, scale_shape, function):
  hidden, weight, labels = _problem(rng, dtype)
  scale = _scale(rng, scale_shape)
  cot = rng.standard_normal(labels.shape)
  head = dict(logit_softcap=5.0, shift=True)

  # Each returns (the scalar differentiated, the values compared): the
  # log-probs themselves, as their sum against a random cotangent can cancel
  # to a small number that no relative tolerance suits.
  def library(h, w, a):
    if function == "cross_entropy":
      loss = mst_jax.linear_cross_entropy(h, w, labels, logit_scale=a, **head)
      return loss, loss
    lp = mst_jax.linear_log_probs(h, w, labels, logit_scale=a, chunk_size=8, **head)
    return jnp.sum(lp * jnp.asarray(cot, lp.dtype)), lp

  def oracle(h, w, a):
    logits = (h @ w.T) * jnp.broadcast_to(a, labels.shape)[..., None]
    if function == "cross_entropy":
      loss = oracle64.cross_entropy_of_logits(logits, labels, **head)
      return loss, loss
    lp = oracle64.log_probs_of_logits(logits, labels, **head)
    return jnp.sum(lp * cot), lp

  args = (hidden, weight, scale)
  grad = jax.value_and_grad(library, argnums=(0, 1, 2), has_aux=True)
  (_, value), grads = jax.jit(grad)(*args)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(to64(x)) for x in args]
    grad64 = jax.value_and_grad(oracle, argnums=(0, 1, 2), has_aux=True)
    (_, ref), ref_grads = grad64(*args64)
  assert value.shape == ref.shape
  assert _rel(value, ref) < TOL[dtype]
  for name, g, r in zip(
    ("dhidden", "dweight", "dscale"), grads, ref_grads, strict=True
  ):
    assert g.shape == r.shape, name
    assert _rel(g, r) < TOL[dtype], (name, _rel(g, r))


def test_top_k_with_a_scale_per_sequence(rng):
  hidden, weight, _ = _problem(rng, "float32")
  scale = _scale(rng, (3, 1))
  log_probs, ids = jax.jit(
    lambda a: mst_jax.linear_top_k(hidden, weight, 4, logit_scale=a)
  )(scale)
  logits = to64(hidden) @ to64(weight).T * np.asarray(scale, np.float64)[..., None]
  m = logits.max(-1, keepdims=True)
  lsm = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  want_values = -np.sort(-lsm, axis=-1)[..., :4]
  assert _rel(log_probs, want_values) < 1e-5
  assert np.array_equal(
    np.take_along_axis(lsm, np.asarray(ids), -1).argmax(-1), np.zeros((3, 10))
  )


def test_scale_array_errors(rng):
  hidden, weight, labels = _problem(rng, "float32")
  bias = jnp.zeros(weight.shape[0])
  with pytest.raises(NotImplementedError, match="bias"):
    mst_jax.linear_cross_entropy(
      hidden, weight, labels, bias, logit_scale=_scale(rng, (3, 1))
    )
  with pytest.raises(ValueError, match="broadcast to hidden's leading shape"):
    mst_jax.linear_log_probs(hidden, weight, labels, logit_scale=_scale(rng, (4, 1)))
  with pytest.raises(TypeError, match="floating"):
    mst_jax.linear_cross_entropy(
      hidden, weight, labels, logit_scale=jnp.ones((3, 1), int)
    )
