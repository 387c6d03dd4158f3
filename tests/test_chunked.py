"""Properties of the chunked driver itself: skipping, frozen inputs, memory."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  GRAD_RTOL,
  LOSS_RTOL,
  assert_close,
  make_problem,
  matmul_shapes,
  oracle,
  output_shapes,
)

import mst_jax
from mst_jax import _kernels as backends
from mst_jax._math import ce as ce_math
from mst_jax._sweep.driver import Plan, reduced_loss, row_losses
from mst_jax._sweep.row_chunks import RowChunks
from mst_jax._sweep.rows import SweepConfig


def _plan(
  vocab_size,
  rows_per_chunk,
  callback=None,
  compact=True,
  rows_per_group=None,
  **options,
):
  config = SweepConfig(
    backend=backends.XlaChunkCE(),
    head=backends.HeadSpec(
      "vd", jnp.dtype(jnp.float32), ce_math.CEOptions(**options), vocab_size
    ),
    dweight_dtype=jnp.dtype(jnp.float32),
    dbias_dtype=jnp.dtype(jnp.float32),
    chunk_callback=callback,
  )
  order = RowChunks(rows_per_chunk, rows_per_group or rows_per_chunk, compact)
  return Plan(config, order)


def _run_recorded(problem, grad_mode, compact, chunk=8, group=None):
  """Loss and grads through the driver; returns them and the computed chunks."""
  computed = {"forward": [], "backward": [], "fused": []}
  plan = _plan(
    problem.weight.shape[0],
    chunk,
    lambda name, first_row: computed[name].append(int(first_row)),
    compact,
    group,
    z_loss=1e-3,
  )

  def loss_fn(hidden, weight, labels, bias, where):
    args = (hidden, weight, bias, labels, where)
    scale = where / jnp.sum(where)
    if grad_mode == "fused":
      return reduced_loss(plan, scale, *args)[0]
    return jnp.sum(row_losses(plan, *args)[0] * scale)

  loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 3))(
    *problem.args, problem.where
  )
  jax.effects_barrier()
  return loss, grads, {k: sorted(v) for k, v in computed.items() if v}


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_fully_masked_chunks_are_skipped(rng, grad_mode):
  """Only chunks with a valid row run; compaction packs valid rows into few.

  60 rows in chunks of 8 (first rows 0, 8, ..., 48, then 52). Without
  compaction, the last chunk is clamped to rows 52..59 and owns 56..59 only,
  so its valid row 53 (owned by the chunk at 48) must not make it run. With
  compaction the four valid rows fill part of the first chunk. In groups of 24
  rows (0, 24, then 36 clamped), chunks of 8 within them, a group with a
  valid row runs whole.
  """
  problem = make_problem(rng, (60,), mask="none", bias=True)
  valid = np.zeros(60, bool)
  valid[[17, 20, 40, 53]] = True  # chunks 2, 2, 5, 6
  problem.where = jnp.asarray(valid)
  ref_loss, ref_grads = oracle(problem, z_loss=1e-3)
  passes = ["fused"] if grad_mode == "fused" else ["forward", "backward"]
  expectations = [
    (False, None, [16, 40, 48]),
    (True, None, [0]),
    # group 36..59 owns 48..59 and holds row 53: it runs whole
    (False, 24, [0, 24, 36]),
    (True, 24, [0]),
  ]
  for compact, group, first_rows in expectations:
    loss, grads, computed = _run_recorded(problem, grad_mode, compact, 8, group)
    if grad_mode == "recompute":  # the forward pass is not grouped
      assert computed["forward"] == ([16, 40, 48] if not compact else [0])
      computed.pop("forward")
      passes = ["backward"]
    assert computed == dict.fromkeys(passes, first_rows), (compact, group, computed)
    assert_close(loss, ref_loss, LOSS_RTOL["float32"], "loss")
    for g, r in zip(grads, ref_grads, strict=True):
      assert_close(g, r, GRAD_RTOL["float32"], "grad")
    np.testing.assert_array_equal(np.asarray(grads[0])[~valid], 0.0)


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize("weight_layout", ["vd", "dv"])
def test_frozen_inputs_skip_their_gradient_work(rng, weight_layout, grad_mode):
  problem = make_problem(rng, (37,), bias=True, weight_layout=weight_layout)
  chunk = 8
  dweight_shape = problem.weight.shape
  dhidden_shape = (chunk, problem.hidden.shape[-1])

  def loss(hidden, weight, bias):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      problem.labels,
      bias,
      where=problem.where,
      impl="xla",
      chunk_size=chunk,
      weight_layout=weight_layout,
      grad_mode=grad_mode,
    )

  def shapes(argnums, primitive="dot_general"):
    fn = jax.grad(loss, argnums=argnums)
    return output_shapes(
      fn, problem.hidden, problem.weight, problem.bias, primitive=primitive
    )

  everything = shapes((0, 1, 2))
  assert dweight_shape in everything and dhidden_shape in everything
  assert (problem.weight.shape[0 if weight_layout == "vd" else 1],) in shapes(
    (0, 1, 2), "reduce_sum"
  )
  frozen_weight = shapes((0,))
  assert dweight_shape not in frozen_weight and dhidden_shape in frozen_weight
  frozen_hidden = shapes((1,))
  assert dhidden_shape not in frozen_hidden and dweight_shape in frozen_hidden
  vocab = problem.bias.shape
  assert vocab not in shapes((0, 1), "reduce_sum")


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_masked_cpu_step_holds_one_copy_of_the_matmuls(rng):
  """On the CPU a group with excluded rows runs whole: the step's program
  holds the three products (logits, ``dhidden``, ``dweight``; one vocabulary
  tile) once, where a window per chunk count would hold them once per count
  (here 104-row groups of 16-row chunks: 7 counts, 24 products). Its
  gradients match the oracle."""
  for mask in ("none", "scattered"):
    problem = make_problem(rng, (300,), mask=mask)
    loss = lambda h, w, p=problem: mst_jax.linear_cross_entropy(
      h, w, p.labels, where=p.where, memory_budget=2_000_000
    )
    step = jax.value_and_grad(loss, argnums=(0, 1))
    args = (problem.hidden, problem.weight)
    assert len(matmul_shapes(step, *args)) == 3, mask
    value, grads = step(*args)
    ref_loss, ref_grads = oracle(problem)
    assert_close(value, ref_loss, LOSS_RTOL["float32"], "loss")
    for g, r in zip(grads, ref_grads[:2], strict=True):
      assert_close(g, r, GRAD_RTOL["float32"], "grad")


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_temporaries_grow_with_chunk_not_with_tokens(rng, grad_mode):
  """Compiled temporaries: O(chunk x V + V x D + N x D), never O(N x V)."""
  vocab, dim, chunk = 4099, 16, 64

  def step_bytes(n_rows):
    problem = make_problem(rng, (n_rows,), dim=dim, vocab=vocab, mask="none")
    fn = jax.value_and_grad(
      lambda h, w: mst_jax.linear_cross_entropy(
        h, w, problem.labels, impl="xla", chunk_size=chunk, grad_mode=grad_mode
      ),
      argnums=(0, 1),
    )
    return _temp_bytes(fn, problem.hidden, problem.weight)

  small, large = step_bytes(1024), step_bytes(4096)
  full_logits = 4096 * vocab * 4
  assert large < full_logits / 8, (large, full_logits)
  # 3072 more rows may add O(rows x D) bytes, not O(rows x V).
  assert large - small < 3072 * (vocab * 4) / 16, (small, large)


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
def test_no_temporary_the_size_of_hidden(rng, grad_mode):
  """Compaction and the group ``lax.cond`` copy no ``[N, D]`` buffer.

  Chunks gather their hidden rows and scatter their ``dhidden`` rows through
  the permutation, and the cond returns a group's rows: at a fixed budget
  (fixed groups), more rows add only per-row ``[N]`` temporaries.
  """
  vocab, dim = 1031, 256

  def step_bytes(n_rows):
    problem = make_problem(rng, (n_rows,), dim=dim, vocab=vocab)  # scattered mask
    fn = jax.value_and_grad(
      lambda h, w: mst_jax.linear_cross_entropy(
        h,
        w,
        problem.labels,
        where=problem.where,
        impl="xla",
        memory_budget=1 << 21,
        grad_mode=grad_mode,
      ),
      argnums=(0, 1),
    )
    return _temp_bytes(fn, problem.hidden, problem.weight)

  small, large = step_bytes(4096), step_bytes(16384)
  per_row = (large - small) / (16384 - 4096)
  assert per_row < dim * 4 / 4, (small, large, per_row)  # well below a row of D


@pytest.mark.parametrize(
  "grad_mode, logits_dtype, accum_dtype",
  [
    ("fused", None, None),  # logits in place, dweight in bfloat16
    ("fused", None, jnp.float32),
    ("fused", jnp.float32, None),  # float32 logits into a group buffer
    ("recompute", None, None),
  ],
)
def test_no_copy_of_the_weight_gradient_between_groups(
  rng, grad_mode, logits_dtype, accum_dtype
):
  """The optimized program never copies a ``[V, D]`` buffer.

  Several row groups, one of them partly masked, so the sweep has both whole
  and chunked groups. (With a ``lax.cond`` between the two inside the group
  loop, XLA copied the carried ``dweight`` twice: 1 GiB at the Llama-3 head.)
  """
  vocab, dim, n_rows = 1031, 64, 3000
  problem = make_problem(rng, (n_rows,), dim=dim, vocab=vocab, dtype="bfloat16")
  where = jnp.arange(n_rows) < 2100  # two whole groups of 1024, then a partial one
  fn = jax.value_and_grad(
    lambda h, w: mst_jax.linear_cross_entropy(
      h,
      w,
      problem.labels,
      where=where,
      impl="xla",
      memory_budget=700 * vocab * 4,
      grad_mode=grad_mode,
      logits_dtype=logits_dtype,
      accum_dtype=accum_dtype,
    ),
    argnums=(0, 1),
  )
  text = jax.jit(fn).lower(problem.hidden, problem.weight).compile().as_text()
  weight_copy = re.compile(rf"= \w+\[{vocab},{dim}\]\{{[0-9,]*\}} copy\(")
  copies = [
    line.strip()[:120] for line in text.splitlines() if weight_copy.search(line)
  ]
  assert not copies, copies
  assert text.count(f"[{vocab},{dim}]") > 0  # the pattern can match
