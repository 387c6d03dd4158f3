"""The library under JAX's strict configuration modes, and its label dtypes.

``jax_numpy_rank_promotion="raise"`` forbids implicit rank broadcasting and
``jax_numpy_dtype_promotion="strict"`` implicit dtype promotion; codebases
turn them on to catch their own bugs, so the loss must not trip them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  GRAD_RTOL,
  LOOP_ORDERS,
  LOSS_RTOL,
  assert_close,
  make_problem,
  oracle,
  value_and_grads,
)

import mst_jax

CASES = [  # (dtype, impl, loop order, call): every path once
  ("bfloat16", "xla", "row_chunks", dict(grad_mode="fused", label_smoothing=0.1)),
  ("bfloat16", "pallas", "vocab_blocks", dict(grad_mode="fused", z_loss=1e-3)),
  ("bfloat16", "pallas", "row_chunks", dict(grad_mode="recompute", logit_softcap=5.0)),
  ("float32", "xla", "vocab_blocks", dict(reduction="none", shift=True)),
  ("bfloat16", "xla", "vocab_blocks", dict(grad_mode="recompute", logit_scale=0.5)),
  ("float32", "reference", None, dict(label_smoothing=0.1)),
]


@pytest.mark.parametrize("dtype, impl, loop_order, call", CASES)
def test_strict_modes(rng, dtype, impl, loop_order, call):
  """Value and gradients (with a bias, token and class weights) and log-probs
  with the entropy, under both strict modes at once, equal to those without."""
  problem = make_problem(rng, (2, 19), dtype=dtype, bias=True)
  kwargs = dict(call, impl=impl)
  if impl != "reference":
    kwargs.update(chunk_size=16, **LOOP_ORDERS[loop_order])
  token_weights = jnp.asarray(rng.random(problem.labels.shape), jnp.float32)
  class_weights = jnp.asarray(rng.random(problem.weight.shape[0]), jnp.float32)
  if impl == "pallas":
    class_weights = None  # the XLA backend's

  def run():
    def loss(hidden, weight, bias):
      out = mst_jax.linear_cross_entropy(
        hidden,
        weight,
        problem.labels,
        bias,
        where=problem.where,
        token_weights=token_weights,
        class_weights=class_weights,
        **kwargs,
      )
      return jnp.sum(out)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(
      problem.hidden, problem.weight, problem.bias
    )
    entropy = mst_jax.linear_log_probs(
      *problem.args, where=problem.where, return_entropy=True
    )
    return value, grads, entropy

  expected = run()
  # Both modes are part of jax.jit's cache key: the calls below trace anew.
  with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
    got = run()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8", "uint16", "uint32"])
def test_labels_of_any_integer_dtype(rng, dtype):
  """Values outside [0, V) stay out of range (NaN) whatever the dtype; only
  ``ignore_index`` itself, where the dtype can hold it, is ignored."""
  vocab = 100 if dtype.endswith("int8") else 1000
  problem = make_problem(rng, (6,), dim=8, vocab=vocab, mask="none")
  info = np.iinfo(dtype)
  values = [3, 7, info.max, vocab - 1, vocab, info.min]
  if info.min <= -100:
    values[5] = -100  # ignored
  labels = jnp.asarray(np.array(values, dtype))
  loss = mst_jax.linear_cross_entropy(
    problem.hidden, problem.weight, labels, reduction="none", impl="xla"
  )
  int32 = np.asarray(values, np.int64)
  in_range = (int32 >= 0) & (int32 < vocab)
  ignored = int32 == -100
  loss = np.asarray(loss)
  assert np.isfinite(loss[in_range]).all()
  assert np.isnan(loss[~in_range & ~ignored]).all(), loss
  assert (loss[ignored] == 0).all()


@pytest.mark.parametrize(
  "dtype, ignore_index",
  [("uint32", 2**32 - 1), ("uint8", 255), ("int8", -128), ("int32", 2**31)],
)
@pytest.mark.parametrize("shift", [False, True])
def test_ignore_index_at_the_edge_of_the_labels_dtype(rng, dtype, ignore_index, shift):
  """An ``ignore_index`` the dtype holds at its edge excludes its tokens (as
  -100 does for int32 labels); one it cannot hold excludes none."""
  problem = make_problem(rng, (3, 7), dim=8, vocab=100, mask="none")
  values = np.asarray(problem.labels).astype(np.int64)
  info = np.iinfo(dtype)
  ignored = np.zeros(values.shape, bool)
  if info.min <= ignore_index <= info.max:
    ignored[0, 1] = ignored[1, 4:] = True
  given = dataclasses.replace(
    problem, labels=jnp.asarray(np.where(ignored, ignore_index, values).astype(dtype))
  )
  expected = dataclasses.replace(
    problem, labels=jnp.asarray(np.where(ignored, -100, values), jnp.int32)
  )
  loss, grads = value_and_grads(
    mst_jax.linear_cross_entropy, given, ignore_index=ignore_index, shift=shift
  )
  ref_loss, ref_grads = oracle(expected, shift=shift)
  assert_close(loss, ref_loss, LOSS_RTOL["float32"], "loss")
  for g, ref in zip(grads, ref_grads, strict=True):
    assert_close(g, ref, GRAD_RTOL["float32"], "gradient")


def test_int64_labels_keep_their_value():
  """Under x64, 2**32 + 3 is out of range, not class 3."""
  with jax.enable_x64(True):
    hidden = jnp.ones((3, 8))
    weight = jnp.ones((50, 8))
    labels = jnp.asarray([2**32 + 3, 3, -100], jnp.int64)
    loss = np.asarray(
      mst_jax.linear_cross_entropy(hidden, weight, labels, reduction="none")
    )
  assert np.isnan(loss[0]) and np.isfinite(loss[1]) and loss[2] == 0


def test_zero_hidden_size_raises():
  with pytest.raises(ValueError, match="D"):
    mst_jax.linear_cross_entropy(
      jnp.ones((4, 0)), jnp.ones((10, 0)), jnp.zeros((4,), jnp.int32)
    )


@pytest.mark.parametrize("strict", [False, True])
def test_mixed_float_dtypes_compute_in_the_wider(rng, strict):
  """float32 hidden, bfloat16 weight: the same values as a float32 weight
  holding the bfloat16 values, and each gradient in its input's dtype."""
  problem = make_problem(rng, (29,), dtype="float32", mask="none")
  weight16 = problem.weight.astype(jnp.bfloat16)
  step = jax.value_and_grad(mst_jax.linear_cross_entropy, argnums=(0, 1))
  mode = jax.numpy_dtype_promotion("strict" if strict else "standard")
  with mode:
    value, (dh, dw) = step(problem.hidden, weight16, problem.labels)
  ref_value, (ref_dh, ref_dw) = step(
    problem.hidden, weight16.astype(jnp.float32), problem.labels
  )
  assert dh.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(value), np.asarray(ref_value))
  np.testing.assert_array_equal(np.asarray(dh), np.asarray(ref_dh))
  np.testing.assert_array_equal(
    np.asarray(dw, np.float32), np.asarray(ref_dw.astype(jnp.bfloat16), np.float32)
  )
