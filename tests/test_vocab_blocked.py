"""What is particular to the low-memory loop order (``vocab_block_size``).

Vocabulary blocks of 1, 7, 128, V - 1, V and more than V columns, with a
remainder block wherever V is not a multiple; row chunks that do not divide N;
its row planning and its matmuls. Every option, mask, reduction, layout and
gradient mode runs in the shared suite (test_linear_cross_entropy.py), whose
``loop_order`` axis includes this order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  ALL_OPTIONS,
  check_against_oracle,
  make_problem,
  matmul_shapes,
)

import mst_jax
from mst_jax import _plan

V = 1031


@pytest.mark.parametrize("block", [1, 7, 128, V - 1, V, 4096])
def test_block_sizes(rng, block):
  problem = make_problem(rng, (37,), vocab=V, bias=True, mask="scattered")
  check_against_oracle(
    problem, "float32", impl="xla", vocab_block_size=block, chunk_size=16
  )


def test_memory_budget_plans_the_rows(rng):
  problem = make_problem(rng, (300,), dim=32, vocab=V, mask="scattered")
  # 8 rows' worth of budget: 8-row chunks (the budget is below 128 rows).
  per_row = 4 * 32 + (4 + 4) * 128
  assert (
    _plan.plan_vocab_blocked_rows(300, 32, 128, np.float32, memory_budget=8 * per_row)
    == 8
  )
  assert _plan.plan_vocab_blocked_rows(300, 32, 128, np.float32) == 300
  check_against_oracle(
    problem, "float32", impl="xla", vocab_block_size=128, memory_budget=8 * per_row
  )


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
  count = lambda argnums: len(
    matmul_shapes(jax.grad(f, argnums), problem.hidden, problem.weight)
  )
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
