"""Multi-device: ``mesh=`` a mesh with Explicit axes over plain arrays, eagerly
and under ``jax.jit``, without ``jax.set_mesh``. Run by
``tests/test_multidevice.py`` on 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import GRAD_RTOL, LOSS_RTOL, assert_close, make_problem, to64

import mst_jax

N, D, V = 48, 16, 1032


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("axes", [("data", None), (None, "model"), ("data", "model")])
def test_an_explicit_mesh_argument_needs_no_set_mesh(rng, jit, axes):
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes by default
  assert jax.sharding.AxisType.Explicit in mesh.axis_types
  problem = make_problem(rng, (N,), dim=D, vocab=V)
  batch_axis, vocab_axis = axes
  mesh_args = dict(mesh=mesh, batch_axis=batch_axis, vocab_axis=vocab_axis)

  def ce(h, w):
    return mst_jax.linear_cross_entropy(
      h, w, problem.labels, where=problem.where, impl="xla", chunk_size=8, **mesh_args
    )

  def lp(h, w):
    out = mst_jax.linear_log_probs(
      h, w, problem.labels, where=problem.where, impl="xla", chunk_size=8, **mesh_args
    )
    return jnp.sum(out * cotangent)

  cotangent = jnp.asarray(rng.standard_normal(N), jnp.float32)
  for fn, reference in ((ce, _oracle_ce), (lp, _oracle_lp)):
    grad = jax.value_and_grad(fn, argnums=(0, 1))
    value, grads = (jax.jit(grad) if jit else grad)(problem.hidden, problem.weight)
    ref_value, ref_grads, magnitude = reference(problem, cotangent)
    # Relative to the summed terms' magnitude: a sum against random-sign
    # cotangents can cancel far below the size of its float32 rounding.
    rtol = LOSS_RTOL["float32"] * 10
    assert_close(value, ref_value, rtol, "loss", atol=rtol * magnitude)
    for name, g, ref in zip(("dhidden", "dweight"), grads, ref_grads, strict=True):
      assert g.shape == ref.shape
      assert_close(g, ref, GRAD_RTOL["float32"], name)


def _oracle_ce(problem, cotangent):
  del cotangent
  with jax.enable_x64(True):
    fn = lambda h, w: oracle.cross_entropy(h, w, problem.labels, where=problem.where)
    value, grads = jax.value_and_grad(fn, argnums=(0, 1))(
      to64(problem.hidden), to64(problem.weight)
    )
    return np.asarray(value), [np.asarray(g) for g in grads], abs(float(value))


def _oracle_lp(problem, cotangent):
  with jax.enable_x64(True):
    terms = lambda h, w: (
      oracle.log_probs(h, w, problem.labels, where=problem.where) * to64(cotangent)
    )
    args = (to64(problem.hidden), to64(problem.weight))
    fn = lambda h, w: jnp.sum(terms(h, w))
    value, grads = jax.value_and_grad(fn, argnums=(0, 1))(*args)
    magnitude = float(jnp.sum(jnp.abs(terms(*args))))
    return np.asarray(value), [np.asarray(g) for g in grads], magnitude
