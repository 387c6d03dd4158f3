"""The low-memory loop order (``vocab_block_size``) against the float64 oracle.

Vocabulary blocks of 1, 7, 128, V - 1, V and more than V columns, with a
remainder block wherever V is not a multiple; row chunks that do not divide N;
every option, mask, reduction and gradient mode; both backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  LOSS_RTOL,
  assert_close,
  check_against_oracle,
  make_problem,
  to64,
  value_and_grads,
)

import mst_jax
from mst_jax import _planning as config

ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)
V = 1031


@pytest.fixture(params=["xla", "pallas"])
def impl(request):
  return request.param


@pytest.fixture(params=["fused", "recompute"])
def grad_mode(request):
  return request.param


@pytest.mark.parametrize("block", [1, 7, 128, V - 1, V, 4096])
def test_block_sizes(rng, block):
  problem = make_problem(rng, (37,), vocab=V, bias=True, mask="scattered")
  check_against_oracle(
    problem, "float32", impl="xla", vocab_block_size=block, chunk_size=16
  )


@pytest.mark.parametrize(
  "options, dtype",
  [
    ({}, "float32"),
    (ALL_OPTIONS, "float32"),
    ({}, "bfloat16"),
    (ALL_OPTIONS, "bfloat16"),
  ],
  ids=["plain-f32", "all-f32", "plain-bf16", "all-bf16"],
)
def test_options_and_dtypes(rng, impl, grad_mode, options, dtype):
  problem = make_problem(
    rng, (3, 13), vocab=V, dtype=dtype, bias=True, mask="scattered"
  )
  check_against_oracle(
    problem,
    dtype,
    impl=impl,
    grad_mode=grad_mode,
    vocab_block_size=256,
    chunk_size=16,
    **options,
  )


@pytest.mark.parametrize("mask", ["none", "prefix", "scattered"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_masks_and_reductions(rng, mask, reduction):
  problem = make_problem(rng, (4, 10), vocab=V, mask=mask)
  check_against_oracle(
    problem,
    "float32",
    impl="xla",
    reduction=reduction,
    vocab_block_size=300,
    chunk_size=12,
    **ALL_OPTIONS,
  )


def test_weight_layout_dv(rng, grad_mode):
  problem = make_problem(rng, (29,), vocab=V, bias=True, weight_layout="dv")
  check_against_oracle(
    problem,
    "float32",
    impl="xla",
    weight_layout="dv",
    grad_mode=grad_mode,
    vocab_block_size=200,
    chunk_size=8,
  )


def test_memory_budget_plans_the_rows(rng):
  problem = make_problem(rng, (300,), dim=32, vocab=V, mask="scattered")
  # 8 rows' worth of budget: 8-row chunks (the budget is below 128 rows).
  per_row = 4 * 32 + (4 + 4) * 128
  assert (
    config.plan_vocab_blocked_rows(300, 32, 128, np.float32, memory_budget=8 * per_row)
    == 8
  )
  assert config.plan_vocab_blocked_rows(300, 32, 128, np.float32) == 300
  check_against_oracle(
    problem, "float32", impl="xla", vocab_block_size=128, memory_budget=8 * per_row
  )


def test_return_aux_counts_the_first_argmax(rng, impl):
  problem = make_problem(rng, (3, 13), vocab=V, bias=True)
  logits = to64(problem.hidden) @ to64(problem.weight).T + to64(problem.bias)
  labels = np.asarray(problem.labels).copy()
  labels[:, ::2] = np.argmax(logits, axis=-1)[:, ::2]
  problem.labels = jnp.asarray(labels)
  kwargs = dict(where=problem.where, **ALL_OPTIONS)
  loss, aux = mst_jax.linear_cross_entropy(
    *problem.args, impl=impl, vocab_block_size=100, return_aux=True, **kwargs
  )
  ref_loss, ref_aux = mst_jax.reference.linear_cross_entropy(
    *problem.args, return_aux=True, **kwargs
  )
  assert_close(loss, np.asarray(ref_loss), LOSS_RTOL["float32"], "loss")
  assert_close(aux.lse, np.asarray(ref_aux.lse), LOSS_RTOL["float32"], "lse")
  expected = np.sum((np.argmax(logits, axis=-1) == labels) & np.asarray(problem.where))
  assert int(aux.n_correct) == int(ref_aux.n_correct) == expected > 0


def test_all_masked_and_excluded_rows_are_exact_zeros(rng, grad_mode):
  problem = make_problem(rng, (37,), vocab=V, mask="scattered", bias=True)
  kwargs = dict(impl="xla", vocab_block_size=128, chunk_size=8, grad_mode=grad_mode)
  _, (dhidden, _, _) = value_and_grads(mst_jax.linear_cross_entropy, problem, **kwargs)
  excluded = ~np.asarray(problem.where)
  np.testing.assert_array_equal(np.asarray(dhidden)[excluded], 0.0)
  problem = make_problem(rng, (37,), vocab=V, mask="all", bias=True)
  loss, grads = value_and_grads(mst_jax.linear_cross_entropy, problem, **kwargs)
  np.testing.assert_array_equal(loss, 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)


def test_label_in_the_remainder_block_and_out_of_range(rng):
  problem = make_problem(rng, (12,), vocab=V)
  labels = np.asarray(problem.labels).copy()
  labels[:6] = V - 1 - np.arange(6)  # all in the 31-column remainder of 1000-blocks
  problem.labels = jnp.asarray(labels)
  check_against_oracle(problem, "float32", impl="xla", vocab_block_size=1000)
  labels[7] = V  # not ignore_index, outside [0, V): NaN like every path
  loss = mst_jax.linear_cross_entropy(
    problem.hidden,
    problem.weight,
    jnp.asarray(labels),
    vocab_block_size=1000,
    reduction="none",
  )
  assert np.isnan(np.asarray(loss)[7]) and np.isfinite(np.asarray(loss)[:7]).all()


def test_frozen_weight_runs_no_dweight_matmul(rng):
  problem = make_problem(rng, (16,), dim=8, vocab=64)
  f = lambda h, w: mst_jax.linear_cross_entropy(
    h, w, problem.labels, impl="xla", vocab_block_size=16
  )
  count = lambda argnums: str(
    jax.make_jaxpr(jax.grad(f, argnums))(problem.hidden, problem.weight)
  ).count("dot_general")
  # Statistics: block 0, then the scan's block (2); gradients: logits, dhidden
  # and, unless the weight is frozen, dweight.
  assert count(0) == 4
  assert count((0, 1)) == 5


def test_reference_takes_no_block_size():
  h, w, y = jnp.ones((4, 8)), jnp.ones((16, 8)), jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="vocab_block_size"):
    mst_jax.linear_cross_entropy(h, w, y, vocab_block_size=8, impl="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_real_vocabulary(rng, dtype):
  """The Llama-3 vocabulary in 2048-column blocks (62 full + a 1280 remainder)."""
  problem = make_problem(rng, (1000,), dim=256, vocab=128256, dtype=dtype, bias=True)
  check_against_oracle(
    problem,
    dtype,
    impl="pallas",
    vocab_block_size=2048,
    chunk_size=384,
    **ALL_OPTIONS,
  )
