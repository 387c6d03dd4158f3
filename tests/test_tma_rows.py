"""Rows appended for the Mosaic GPU kernels' TMA tiles.

The Mosaic kernels move rows in tiles of 8. A plan whose one block of rows
holds all N rows, N not a multiple of 8, appends rows that count for nothing
(``_plan.tma_row_padding``). On the CPU, where the rule never asks for
them, the tests append rows anyway and compare the loss and gradients with
the float64 oracles; lowered for Hopper, a step over an unaligned N calls
only Mosaic GPU kernels, no Triton kernel and no XLA GEMM.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_distillation
import test_log_probs
from conftest import ALL_OPTIONS, check_against_oracle, make_problem
from hypothesis import given, settings
from hypothesis import strategies as st

import mst_jax
from mst_jax import _plan
from mst_jax._args import inputs as _inputs
from mst_jax._sweep import distill as _distill_sweep

BF16 = np.dtype(jnp.bfloat16)


@pytest.mark.parametrize(
  "n_rows, blocks, gemm, dtype, want",
  [
    (8191, (1024, 8191), "mosaic", BF16, 1),  # one group of every row
    (1001, (1001,), "mosaic", np.dtype(np.float16), 7),
    (5, (5, 5), "mosaic", BF16, 3),
    (8192, (1024, 8192), "mosaic", BF16, 0),  # aligned
    (65535, (1024, 8192), "mosaic", BF16, 0),  # blocks of 8 i rows, clamped
    (8191, (1024, 8191), "xla", BF16, 0),  # XLA's GEMMs take any rows
    (8191, (1024, 8191), "mosaic", np.dtype(np.float32), 0),  # XLA's GEMMs
  ],
)
def test_rows_are_appended_only_where_a_block_is_unaligned(
  n_rows, blocks, gemm, dtype, want
):
  assert _plan.tma_row_padding(n_rows, blocks, gemm, dtype) == want


@settings(deadline=None, max_examples=30)
@given(
  groups=st.integers(1, 4),
  per_group=st.integers(0, 9),
  count=st.integers(0, 7),
  trailing=st.sampled_from([(), (3,)]),
)
def test_each_block_of_rows_gets_its_own_appended_rows(
  groups, per_group, count, trailing
):
  """``append_rows`` appends ``count`` rows of the fill to each of the
  ``groups`` blocks (a data-parallel mesh's devices' rows), and
  ``drop_appended`` gives the rows back."""
  x = np.arange(groups * per_group * int(np.prod(trailing))).reshape(-1, *trailing)
  out = np.asarray(_inputs.append_rows(jnp.asarray(x), count, -1, groups=groups))
  blocks = out.reshape(groups, per_group + count, *trailing)
  np.testing.assert_array_equal(
    blocks[:, :per_group].reshape(x.shape), x
  )  # each block's own rows, in order
  assert (blocks[:, per_group:] == -1).all()
  back = _inputs.drop_appended(jnp.asarray(out), count, groups=groups)
  np.testing.assert_array_equal(np.asarray(back), x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(reduction="sum", **ALL_OPTIONS),
    dict(reduction="none", bias=True),
    dict(grad_mode="recompute", shift=True),
    dict(weight_layout="dv", chunk_size=16),
  ],
  ids=str,
)
def test_appended_rows_change_no_loss_or_gradient(appended, rng, dtype, kwargs):
  kwargs = dict(kwargs)
  problem = make_problem(
    rng,
    (3, 13),
    dim=40,
    vocab=515,
    dtype=dtype,
    bias=kwargs.pop("bias", False),
    weight_layout=kwargs.get("weight_layout", "vd"),
  )
  check_against_oracle(problem, dtype, **kwargs)
  assert appended and set(appended) == {39}


@pytest.mark.parametrize("class_weights", [False, True], ids=str)
def test_appended_rows_under_a_banned_first_class(appended, rng, class_weights):
  """A bias of -inf at classes 0-2: the appended rows' label is a class of
  finite score, so their loss is finite and zero weight makes it nothing
  (label 0 gave an infinite loss, and 0 x inf a NaN scalar)."""
  # D < N: the gradient in the forward, whose scalar sums every row's loss.
  problem = make_problem(rng, (3, 13), dim=16, vocab=515, bias=True, mask="none")
  problem.bias = problem.bias.at[:3].set(-jnp.inf)
  problem.labels = jnp.maximum(problem.labels, 3)
  kwargs = dict(z_loss=1e-3)
  if class_weights:  # smoothing over the classes of nonzero weight only
    weights = jnp.asarray(rng.random(515), jnp.float32).at[:3].set(0)
    kwargs.update(class_weights=weights, label_smoothing=0.1)
  loss, grads = check_against_oracle(problem, "float32", **kwargs)
  assert np.isfinite(float(loss)) and appended


def test_appended_rows_leave_the_gradient_mode_as_it_was(appended, rng):
  """39 rows of D=40 recompute by default (fewer rows than D); the 5 rows
  appended must not make them 44 rows in the fused mode, whose lse (here
  through the z-loss aux) is not differentiable."""
  problem = make_problem(rng, (39,), dim=40, vocab=515, mask="none")

  def loss(hidden):
    value, aux = mst_jax.linear_cross_entropy(
      hidden, problem.weight, problem.labels, return_aux=True
    )
    return value + jnp.sum(aux.lse)

  grad = jax.grad(loss)(problem.hidden)
  assert np.isfinite(np.asarray(grad)).all() and appended == [39]


@pytest.mark.parametrize("chunk_size, want", [(1004, 1008), (None, 1008), (512, 512)])
def test_a_distillation_chunk_of_all_rows_holds_the_appended_ones(
  as_if_on_hopper, monkeypatch, chunk_size, want
):
  """Planned once: a chunk of all 1001 rows (given or planned) holds the 7
  appended ones; chunks of 512 rows are whole TMA tiles and get none."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  zeros = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  x = _distill_sweep.Heads(
    zeros(1001, 64), zeros(1024, 64), None, zeros(1001, 96), zeros(1024, 96),
    None, None, None,
  )  # fmt: skip
  perf = mst_jax.PerfOptions(chunk_size=chunk_size)
  plan, heads, appended = _distill_sweep.resolve(x, None, perf, "vd")
  assert plan.rows_per_chunk == want and appended == (7 if want == 1008 else 0)
  assert heads is x


@pytest.mark.parametrize("return_entropy", [False, True], ids=str)
def test_appended_rows_in_log_probs(appended, rng, return_entropy):
  problem = make_problem(rng, (3, 13), dim=40, vocab=515, mask="prefix", bias=True)
  g_lp, g_h = rng.standard_normal((2, 3, 13))
  out, grads = test_log_probs._run(problem, g_lp, g_h, return_entropy)
  ref_lp, ref_h, ref_grads = test_log_probs._oracle(
    problem, g_lp, g_h if return_entropy else 0 * g_h,
    weight_layout="vd", shift=False, scale=None, softcap=None,
  )  # fmt: skip
  lp, h = out if return_entropy else (out, None)
  assert lp.shape == (3, 13)
  assert test_log_probs._rel(lp, ref_lp) < 1e-5
  if return_entropy:
    assert test_log_probs._rel(h, ref_h) < 1e-5
  for got, want in zip(grads, ref_grads, strict=True):
    assert test_log_probs._rel(got, want) < 1e-5
  assert appended


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
  "options", [dict(), dict(divergence="jsd", hard_label_weight=0.5)]
)
def test_appended_rows_in_distillation(appended, rng, reduction, options):
  pair = test_distillation.make_pair(rng, (3, 13), bias="finite")
  test_distillation.check(pair, "float32", reduction=reduction, **options)
  assert appended and set(appended) == {39}


def test_appended_rows_in_distillation_under_a_banned_first_class(appended, rng):
  """Both heads ban class 0 (bias -inf): the appended rows' hard label is a
  class of finite score, so the summed loss stays finite."""
  pair = test_distillation.make_pair(rng, (3, 13), bias="finite")
  banned = lambda b: b.at[0].set(-jnp.inf)
  pair = dataclasses.replace(
    pair,
    student_bias=banned(pair.student_bias),
    teacher_bias=banned(pair.teacher_bias),
    labels=jnp.maximum(pair.labels, 1),
  )
  test_distillation.check(pair, "float32", hard_label_weight=0.5)
  assert appended


def _kernels(text: str) -> tuple[int, int, int]:
  """``(Mosaic GPU kernels, Triton kernels, XLA GEMMs)`` called by a lowered step."""
  mosaic = text.count("custom_call @mosaic_gpu")
  return mosaic, text.count("triton"), len(re.findall(r"stablehlo\.dot_general", text))


@pytest.mark.parametrize(
  "loss",
  ["cross_entropy", "chunk_size", "per_token", "log_probs", "distillation"],
)
def test_an_unaligned_step_lowers_to_mosaic_kernels_only(
  as_if_on_hopper, monkeypatch, loss
):
  """1001 rows: without the appended rows, the one block of every row ran on
  XLA's GEMMs and the Triton kernels."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # distillation's
  n, d, v = 1001, 256, 32000
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = (shape(n, d), shape(v, d), shape(n, 384), shape(v, 384))
  labels = jnp.zeros((n,), jnp.int32)

  def step(h, w, teacher_h, teacher_w):
    if loss == "cross_entropy":
      return mst_jax.linear_cross_entropy(h, w, labels)
    if loss == "chunk_size":  # of all 1001 rows; not of the 1008
      return mst_jax.linear_cross_entropy(h, w, labels, chunk_size=1004)
    if loss == "per_token":
      return jnp.sum(mst_jax.linear_cross_entropy(h, w, labels, reduction="none"))
    if loss == "log_probs":
      lp, entropy = mst_jax.linear_log_probs(h, w, labels, return_entropy=True)
      return jnp.sum(lp) + jnp.sum(entropy)
    return mst_jax.linear_distillation_loss(h, w, teacher_h, teacher_w)

  lowered = jax.jit(jax.value_and_grad(step, argnums=(0, 1))).trace(*args)
  mosaic, triton, xla_gemms = _kernels(
    lowered.lower(lowering_platforms=("cuda",)).as_text()
  )
  assert mosaic > 0 and triton == 0 and xla_gemms == 0, (mosaic, triton, xla_gemms)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "kwargs", [dict(), dict(reduction="none", **ALL_OPTIONS)], ids=str
)
def test_an_unaligned_step_on_the_gpu(rng, kwargs):
  """1001 tokens on the default (Mosaic on a Hopper GPU) against the float64
  oracle: the appended rows run through the kernels and count for nothing."""
  problem = make_problem(
    rng, (7, 143), dim=256, vocab=32000, dtype="bfloat16", mask="none"
  )
  check_against_oracle(problem, "bfloat16", **kwargs)


@pytest.mark.gpu
def test_an_unaligned_data_parallel_step_on_the_gpu(rng):
  """The same rows on a one-device mesh that splits them (data parallel):
  the device's block of rows gets its rows appended."""
  problem = make_problem(
    rng, (7, 143), dim=256, vocab=32000, dtype="bfloat16", mask="scattered"
  )
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  check_against_oracle(problem, "bfloat16", mesh=mesh, batch_axis="data")


@pytest.mark.gpu
def test_unaligned_distillation_on_the_gpu(rng):
  pair = test_distillation.make_pair(rng, (7, 143), "bfloat16", vocab=32000)
  test_distillation.check(pair, "bfloat16_logits", hard_label_weight=0.5)


@settings(max_examples=300, deadline=None)
@given(
  n_rows=st.integers(1, 300_000),
  vocab=st.integers(2, 300_000),
  dim=st.sampled_from([64, 768, 2304, 4096]),
  budget=st.sampled_from([None, 1 << 24, 1 << 28, 1 << 30]),
  dtype=st.sampled_from([BF16, np.dtype(np.float32)]),
)
def test_only_a_block_of_every_row_is_unaligned(n_rows, vocab, dim, budget, dtype):
  """What ``tma_row_padding`` relies on: every planner's chunk and group is a
  multiple of 8 rows unless it holds all ``n_rows`` (the one block the rows
  appended make whole)."""
  budget = budget or _plan.DEFAULT_MEMORY_BUDGET
  chunk, group, _ = _plan.plan_with_accumulator(
    n_rows, vocab, dim, dtype, dtype, memory_budget=budget, logits_dtype=dtype
  )
  blocked = _plan.plan_vocab_blocked_rows(
    n_rows, dim, min(4096, vocab), dtype, memory_budget=budget
  )
  distilled = _plan.rows_in_budget(n_rows, 6 * vocab, budget)
  for rows in (chunk, group, blocked, distilled):
    assert rows % _plan.TMA_ROWS == 0 or rows == n_rows, (rows, n_rows)
