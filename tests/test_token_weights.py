"""``token_weights`` against a float64 oracle that weights per-token losses itself.

The oracle takes tests/oracle.py's unweighted per-token losses
(``reduction="none"``) and applies the documented weighting here, so it
shares none of the weighting code it checks (the library's, or the oracle's
own ``token_weights``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  ALL_OPTIONS,
  GRAD_RTOL,
  LOSS_RTOL,
  assert_close,
  lse64,
  make_problem,
  to64,
)

import mst_jax

MODES = [("mean", "fused"), ("mean", "recompute"), ("sum", "fused"), ("none", None)]


def _label_positions(x, shift, fill):
  """What position t uses: ``x[..., t + 1]`` with ``shift`` (``fill`` last)."""
  x = np.asarray(x)
  if not shift:
    return x
  return np.concatenate([x[..., 1:], np.full_like(x[..., :1], fill)], axis=-1)


def _oracle(problem, weights, reduction, shift, **options):
  """float64 (loss, grads) of the weighted loss, from unweighted token losses."""
  where = (
    np.ones(problem.labels.shape, bool) if problem.where is None else problem.where
  )
  valid = (np.asarray(where)) & (np.asarray(problem.labels) != -100)
  valid = _label_positions(valid, shift, False)
  w = _label_positions(weights, shift, 0.0) * valid
  argnums = (0, 1, 2) if problem.bias is not None else (0, 1)
  with jax.enable_x64(True):
    w64 = jnp.asarray(w, jnp.float64)

    def weighted(hidden, weight, bias=None):
      per_token = oracle64.cross_entropy(
        hidden,
        weight,
        problem.labels,
        bias,
        where=problem.where,
        reduction="none",
        shift=shift,
        **options,
      )
      if reduction == "none":
        return per_token * w64
      total = jnp.sum(per_token * w64)
      if reduction == "sum":
        return total
      return jnp.where(jnp.sum(w64) == 0, 0.0, total / jnp.sum(w64))

    inputs = (problem.hidden, problem.weight, problem.bias)[: len(argnums)]
    args = [jnp.asarray(to64(x)) for x in inputs]
    value = weighted(*args)
    scalar = lambda *a: jnp.sum(weighted(*a))
    grads = jax.grad(scalar, argnums=argnums)(*args)
    return np.asarray(value), [np.asarray(g) for g in grads]


def _run(problem, weights, reduction, **kwargs):
  argnums = (0, 1, 3) if problem.bias is not None else (0, 1)

  def loss(hidden, weight, labels, bias):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      bias,
      where=problem.where,
      token_weights=weights,
      reduction=reduction,
      **kwargs,
    )

  value = loss(*problem.args)
  grads = jax.grad(lambda *a: jnp.sum(loss(*a)), argnums=argnums)(*problem.args)
  return value, grads


@pytest.mark.parametrize("reduction, grad_mode", MODES)
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("mask", ["prefix", "scattered"])
def test_token_weights_match_the_oracle(
  rng, impl, loop_order, reduction, grad_mode, shift, mask
):
  problem = make_problem(rng, (3, 13), mask=mask, bias=True)
  weights = jnp.asarray(rng.random((3, 13)) * 2.0, jnp.float32)
  options = dict(ALL_OPTIONS, logit_scale=0.8)
  value, grads = _run(
    problem,
    weights,
    reduction,
    impl=impl,
    chunk_size=8,
    grad_mode=grad_mode,
    shift=shift,
    **options,
    **loop_order,
  )
  ref_value, ref_grads = _oracle(problem, weights, reduction, shift, **options)
  assert value.shape == ref_value.shape
  assert_close(value, ref_value, LOSS_RTOL["float32"], "loss", atol=1e-6)
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, r, GRAD_RTOL["float32"], "grad")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction, grad_mode", MODES)
def test_token_weights_on_the_gpu(rng, reduction, grad_mode):
  """The default GPU backend (Pallas kernels) with token weights, every loss
  option and a logit scale, shifted labels, unaligned sizes; float32 inputs
  at the GPU's matmul precision. ``"none"`` keeps the forward's logits."""
  problem = make_problem(rng, (4, 301), dim=72, vocab=5003, bias=True)
  weights = jnp.asarray(rng.random((4, 301)) * 2.0, jnp.float32)
  options = dict(ALL_OPTIONS, logit_scale=0.8)
  value, grads = _run(
    problem, weights, reduction, grad_mode=grad_mode, shift=True, **options
  )
  ref_value, ref_grads = _oracle(problem, weights, reduction, True, **options)
  assert_close(value, ref_value, 3e-3, "loss", atol=1e-6)
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, r, 3e-3, "grad")


@pytest.mark.parametrize("weight_layout", ["vd", "dv"])
def test_token_weights_with_either_layout(rng, impl, weight_layout):
  problem = make_problem(rng, (29,), weight_layout=weight_layout, mask="none")
  weights = jnp.asarray(rng.random(29), jnp.float32)
  value, grads = _run(
    problem, weights, "mean", impl=impl, chunk_size=8, weight_layout=weight_layout
  )
  ref_value, ref_grads = _oracle(
    problem, weights, "mean", False, weight_layout=weight_layout
  )
  assert_close(value, ref_value, LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, r, GRAD_RTOL["float32"], "grad")


def test_weights_summing_to_zero_give_exact_zeros(rng, impl):
  problem = make_problem(rng, (4, 9), mask="none", bias=True)
  weights = jnp.zeros((4, 9), jnp.float32)
  value, grads = _run(problem, weights, "mean", impl=impl, chunk_size=8)
  np.testing.assert_array_equal(value, 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_any_weight_at_an_excluded_token_has_no_effect(rng, impl, reduction):
  """NaN or inf weights where tokens are excluded change nothing, bit for bit."""
  problem = make_problem(rng, (3, 13), mask="scattered", bias=True)
  weights = np.asarray(rng.random((3, 13)), np.float32)
  zeroed, poisoned = weights.copy(), weights.copy()
  excluded = ~np.asarray(problem.where)
  zeroed[excluded] = 0.0
  poisoned[excluded] = np.where(rng.random(excluded.sum()) > 0.5, np.nan, np.inf)
  # Eagerly too: under jit, XLA may turn a multiply by the mask into a select.
  with jax.disable_jit():
    outputs = [
      _run(problem, jnp.asarray(w), reduction, impl="reference")
      for w in (zeroed, poisoned)
    ]
  outputs += [
    _run(problem, jnp.asarray(w), reduction, impl=impl, chunk_size=8)
    for w in (zeroed, poisoned)
  ]
  for want, got in (outputs[:2], outputs[2:]):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert np.isfinite(np.asarray(g)).all()
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_aux_z_loss_is_weighted_and_lse_is_not(rng, impl):
  problem = make_problem(rng, (3, 13), mask="scattered")
  weights = jnp.asarray(rng.random((3, 13)), jnp.float32)
  kwargs = dict(where=problem.where, z_loss=1e-2, return_aux=True)
  _, aux = mst_jax.linear_cross_entropy(
    *problem.args, token_weights=weights, impl=impl, chunk_size=8, **kwargs
  )
  lse = lse64(problem)
  w = np.asarray(weights) * np.asarray(problem.where)
  expected = np.sum(1e-2 * lse**2 * w) / np.sum(w)
  assert_close(aux.z_loss, expected, 4 * LOSS_RTOL["float32"], "z_loss")
  assert_close(aux.lse, lse, LOSS_RTOL["float32"], "lse")


def test_token_weights_are_not_differentiated(rng):
  problem = make_problem(rng, (17,), mask="none")

  def loss(weights):
    return mst_jax.linear_cross_entropy(*problem.args, token_weights=weights)

  grad = jax.grad(loss)(jnp.ones((17,), jnp.float32))
  np.testing.assert_array_equal(grad, 0.0)


def test_flax_module_takes_token_weights(rng):
  from flax import nnx

  head = mst_jax.nnx.LMHeadLoss(24, 1031, rngs=nnx.Rngs(0), reduction="sum")
  problem = make_problem(rng, (2, 7), mask="none")
  weights = jnp.asarray(rng.random((2, 7)), jnp.float32)
  out = head(problem.hidden, problem.labels, token_weights=weights)
  ref = mst_jax.linear_cross_entropy(
    problem.hidden,
    head.kernel[...],
    problem.labels,
    weight_layout="dv",
    reduction="none",
  )
  expected = np.sum(np.asarray(ref, np.float64) * np.asarray(weights))
  assert_close(out, expected, LOSS_RTOL["float32"], "flax")
