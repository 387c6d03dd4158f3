"""The shared suite: every chunked implementation against the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  ALL_OPTIONS,
  GRAD_RTOL,
  LOSS_RTOL,
  NAIVE_FACTOR,
  assert_close,
  check_against_oracle,
  lse64,
  make_problem,
  oracle,
  to64,
  value_and_grads,
)

import mst_jax
from mst_jax._sweep import row_chunks as _row_chunks
from mst_jax._sweep.gradients import gradient_sweep

# The quick run takes every value of every parameter here (conftest._mark_slow).
EVERY_VALUE_QUICKLY = True

SINGLE_OPTIONS = {
  "plain": {},
  "label_smoothing": dict(label_smoothing=0.2),
  "z_loss": dict(z_loss=1e-2),
  "logit_softcap": dict(logit_softcap=2.5),
  "bias": {},
  "logit_scale": dict(logit_scale=0.6),
  "scale_and_softcap": dict(logit_scale=1.7, logit_softcap=3.0, label_smoothing=0.1),
  "all": ALL_OPTIONS,
}


@pytest.mark.parametrize(
  "option, dtype, logits_dtype",
  [(option, "float32", None) for option in SINGLE_OPTIONS]
  + [
    ("plain", "bfloat16", None),  # bfloat16 logits
    ("all", "bfloat16", None),
    ("plain", "bfloat16", "float32"),  # the loss float32-exact again
    ("all", "bfloat16", "float32"),
    ("all", "float32", "bfloat16"),
  ],
)
def test_each_option_and_all_together(
  rng, impl, option, dtype, logits_dtype, grad_mode, loop_order
):
  problem = make_problem(
    rng, (3, 13), dtype=dtype, bias=option in ("bias", "all"), mask="scattered"
  )
  check_against_oracle(
    problem,
    dtype,
    impl=impl,
    chunk_size=8,
    grad_mode=grad_mode,
    logits_dtype=logits_dtype,
    **SINGLE_OPTIONS[option],
    **loop_order,
  )


@pytest.mark.parametrize("batch_shape", [(37,), (3, 13)], ids=["N_D", "B_T_D"])
@pytest.mark.parametrize("mask", ["none", "prefix", "scattered"])
def test_mask_kinds(rng, impl, batch_shape, mask, grad_mode, loop_order):
  problem = make_problem(rng, batch_shape, mask=mask, bias=True)
  check_against_oracle(
    problem,
    "float32",
    impl=impl,
    chunk_size=8,
    grad_mode=grad_mode,
    **ALL_OPTIONS,
    **loop_order,
  )


@pytest.mark.parametrize("chunk_size", [1, 5, 36, 1000, None])
def test_chunk_sizes(rng, impl, chunk_size, grad_mode):
  """Chunks of 1 row, unaligned ones, exactly N, and larger than N."""
  problem = make_problem(rng, (37,), mask="scattered")
  check_against_oracle(
    problem, "float32", impl=impl, chunk_size=chunk_size, grad_mode=grad_mode
  )


@pytest.mark.parametrize("weight_layout", ["vd", "dv"])
def test_weight_layouts(rng, impl, weight_layout, grad_mode, loop_order):
  problem = make_problem(rng, (2, 11), weight_layout=weight_layout, bias=True)
  check_against_oracle(
    problem,
    "float32",
    impl=impl,
    chunk_size=6,
    weight_layout=weight_layout,
    grad_mode=grad_mode,
    **loop_order,
  )


def test_float16(rng, impl):
  problem = make_problem(rng, (3, 13), dtype="float16", bias=True)
  check_against_oracle(problem, "float16", impl=impl, chunk_size=8, **ALL_OPTIONS)


def test_mixed_input_dtypes(rng, impl):
  """bfloat16 hidden with a float32 weight: each gradient in its input's dtype."""
  problem = make_problem(rng, (29,), dtype="float32")
  problem.hidden = problem.hidden.astype(jnp.bfloat16)
  check_against_oracle(problem, "bfloat16", impl=impl, chunk_size=8)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(rng, impl, reduction, loop_order):
  """Default grad_mode: fused for mean and sum, recompute for none."""
  problem = make_problem(rng, (3, 13), bias=True)
  kwargs = dict(
    impl=impl, chunk_size=8, reduction=reduction, **ALL_OPTIONS, **loop_order
  )
  check_against_oracle(problem, "float32", **kwargs)
  per_token = mst_jax.linear_cross_entropy(*problem.args, where=problem.where, **kwargs)
  with jax.enable_x64(True):
    ref = oracle64.cross_entropy(
      to64(problem.hidden),
      to64(problem.weight),
      problem.labels,
      to64(problem.bias),
      where=problem.where,
      reduction=reduction,
      **ALL_OPTIONS,
    )
  assert per_token.shape == ref.shape == ((3, 13) if reduction == "none" else ())
  assert_close(per_token, np.asarray(ref), LOSS_RTOL["float32"], reduction)


def test_shift(rng, impl):
  problem = make_problem(rng, (3, 13), mask="prefix", bias=True)
  check_against_oracle(problem, "float32", impl=impl, chunk_size=8, shift=True)


def test_shift_matches_shifted_inputs(rng, impl):
  """shift=True equals slicing hidden[..., :-1] and labels[..., 1:] by hand."""
  problem = make_problem(rng, (2, 9), mask="none")
  shifted = mst_jax.linear_cross_entropy(
    problem.hidden,
    problem.weight,
    problem.labels,
    impl=impl,
    shift=True,
    reduction="none",
  )
  by_hand = mst_jax.linear_cross_entropy(
    problem.hidden[:, :-1],
    problem.weight,
    problem.labels[:, 1:],
    impl=impl,
    reduction="none",
  )
  assert shifted.shape == (2, 9)
  np.testing.assert_array_equal(shifted[:, -1], 0.0)
  assert_close(shifted[:, :-1], np.asarray(by_hand, np.float64), 1e-6, "shift")


def test_all_masked_gives_exact_zeros(rng, impl, grad_mode, loop_order):
  problem = make_problem(rng, (3, 13), mask="all", bias=True)
  for reduction in ("mean", "sum") if grad_mode == "fused" else ("mean", "none"):
    loss, grads = value_and_grads(
      mst_jax.linear_cross_entropy,
      problem,
      impl=impl,
      chunk_size=8,
      reduction=reduction,
      grad_mode=grad_mode,
      **ALL_OPTIONS,
      **loop_order,
    )
    np.testing.assert_array_equal(loss, 0.0)
    for g in grads:
      np.testing.assert_array_equal(g, 0.0)


def test_excluded_rows_get_exactly_zero_gradient(rng, impl, grad_mode, loop_order):
  problem = make_problem(rng, (37,), mask="scattered")
  _, (dhidden, _) = value_and_grads(
    mst_jax.linear_cross_entropy,
    problem,
    impl=impl,
    chunk_size=8,
    grad_mode=grad_mode,
    **loop_order,
  )
  excluded = ~np.asarray(problem.where)
  np.testing.assert_array_equal(np.asarray(dhidden)[excluded], 0.0)
  assert np.all(np.any(np.asarray(dhidden)[~excluded] != 0, axis=-1))


def test_ignore_index_and_where_combine(rng, impl):
  problem = make_problem(rng, (4, 10), mask="prefix", ignore_index=7)
  problem.where = jnp.asarray(rng.random((4, 10)) > 0.3)
  check_against_oracle(problem, "float32", impl=impl, chunk_size=8, ignore_index=7)


def test_return_aux(rng, impl, loop_order):
  problem = make_problem(rng, (3, 13), bias=True)
  logits = to64(problem.hidden) @ to64(problem.weight).T + to64(problem.bias)
  labels = np.asarray(problem.labels).copy()
  labels[:, ::2] = np.argmax(logits, axis=-1)[:, ::2]  # softcap keeps the argmax
  problem.labels = jnp.asarray(labels)
  kwargs = dict(where=problem.where, **ALL_OPTIONS)
  loss, aux = mst_jax.linear_cross_entropy(
    *problem.args, impl=impl, chunk_size=8, return_aux=True, **kwargs, **loop_order
  )
  ref_loss, _ = oracle(problem, **ALL_OPTIONS)
  lse = lse64(problem, **ALL_OPTIONS)
  valid = np.asarray(problem.where)
  assert isinstance(aux, mst_jax.LossAux)
  assert_close(loss, ref_loss, LOSS_RTOL["float32"], "loss")
  assert aux.lse.shape == (3, 13)
  assert_close(aux.lse, lse, LOSS_RTOL["float32"], "lse")
  z_loss = ALL_OPTIONS["z_loss"] * np.sum(lse**2) / valid.sum()
  assert_close(aux.z_loss, z_loss, 4 * LOSS_RTOL["float32"], "z")
  assert int(aux.n_valid) == int(np.sum(valid))
  expected = np.sum((np.argmax(logits, axis=-1) == labels) & valid)
  assert int(aux.n_correct) == expected > 0


def test_aux_lse_is_differentiable(rng, impl):
  problem = make_problem(rng, (29,), bias=True)

  def lse_sum(hidden, weight, bias, **kw):
    _, aux = mst_jax.linear_cross_entropy(
      hidden,
      weight,
      problem.labels,
      bias,
      where=problem.where,
      return_aux=True,
      z_loss=1e-2,
      **kw,
    )
    return jnp.sum(aux.lse)

  def lse_sum64(hidden, weight, bias):
    logits = hidden @ weight.T + bias
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(jnp.where(problem.where, lse, 0.0))

  args = (problem.hidden, problem.weight, problem.bias)
  kwargs = dict(impl=impl, chunk_size=8, grad_mode="recompute")
  grads = jax.grad(lse_sum, argnums=(0, 1, 2))(*args, **kwargs)
  with jax.enable_x64(True):
    refs = jax.grad(lse_sum64, argnums=(0, 1, 2))(*(jnp.asarray(to64(x)) for x in args))
  for g, r in zip(grads, refs, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], "dlse")
  with pytest.raises(NotImplementedError, match="grad_mode='recompute'"):
    jax.grad(lse_sum)(*args, impl=impl, chunk_size=8, grad_mode="fused")


def test_out_of_range_labels_give_nan(rng, impl):
  """A label outside [0, V) that is not ignore_index is an error: NaN, loudly."""
  problem = make_problem(rng, (20,), mask="none", vocab=101)
  labels = np.asarray(problem.labels).copy()
  labels[[3, 11]] = [101, -5]
  per_token = mst_jax.linear_cross_entropy(
    problem.hidden,
    problem.weight,
    jnp.asarray(labels),
    impl=impl,
    chunk_size=8,
    reduction="none",
  )
  nan_rows = np.isnan(np.asarray(per_token))
  np.testing.assert_array_equal(np.flatnonzero(nan_rows), [3, 11])
  grads = jax.grad(
    lambda h: mst_jax.linear_cross_entropy(
      h, problem.weight, jnp.asarray(labels), impl=impl, chunk_size=8
    )
  )(problem.hidden)
  assert np.isnan(np.asarray(grads)[[3, 11]]).all()
  # Excluded by where, the same labels are harmless.
  where = ~nan_rows
  loss = mst_jax.linear_cross_entropy(
    problem.hidden,
    problem.weight,
    jnp.asarray(labels),
    where=jnp.asarray(where),
    impl=impl,
    chunk_size=8,
  )
  assert np.isfinite(float(loss))


def test_under_user_jit_and_grad(rng, impl):
  problem = make_problem(rng, (3, 13), bias=True)
  kwargs = dict(impl=impl, chunk_size=8, **ALL_OPTIONS)

  @jax.jit
  def step(hidden, weight, bias):
    return jax.value_and_grad(
      lambda h, w, b: mst_jax.linear_cross_entropy(
        h, w, problem.labels, b, where=problem.where, **kwargs
      ),
      argnums=(0, 1, 2),
    )(hidden, weight, bias)

  loss, grads = step(problem.hidden, problem.weight, problem.bias)
  grad_only = jax.jit(
    jax.grad(
      lambda w: mst_jax.linear_cross_entropy(
        problem.hidden, w, problem.labels, problem.bias, where=problem.where, **kwargs
      )
    )
  )(problem.weight)
  ref_loss, ref_grads = oracle(problem, **kwargs)
  assert_close(loss, ref_loss, LOSS_RTOL["float32"], "loss")
  for g, r in zip(grads, ref_grads, strict=True):
    assert_close(g, r, GRAD_RTOL["float32"], "grad")
  assert_close(grad_only, ref_grads[1], GRAD_RTOL["float32"], "grad only")


@pytest.mark.parametrize("vocab_block_size", [None, 5], ids=["rows", "vocab_blocks"])
def test_check_grads_float64(rng, impl, grad_mode, vocab_block_size):
  """Finite differences against the hand-written VJP, float64.

  Second order only for XLA: a pallas_call has no derivative of its own.
  """
  problem = make_problem(rng, (11,), dim=5, vocab=23, bias=True)
  with jax.enable_x64(True):
    hidden, weight, bias = (
      jnp.asarray(np.asarray(x, np.float64))
      for x in (problem.hidden, problem.weight, problem.bias)
    )

    def f(hidden, weight, bias):
      return mst_jax.linear_cross_entropy(
        hidden,
        weight,
        problem.labels,
        bias,
        where=problem.where,
        impl=impl,
        chunk_size=4,
        vocab_block_size=vocab_block_size,
        grad_mode=grad_mode,
        **ALL_OPTIONS,
      )

    order = 2 if impl == "xla" else 1
    jax.test_util.check_grads(f, (hidden, weight, bias), order=order, modes=["rev"])


@pytest.mark.parametrize("mask", ["none", "scattered"])
@pytest.mark.parametrize(
  "dtype, logits_dtype, budget, plan",
  [
    ("float32", None, 2_000_000, (16, 104)),
    ("bfloat16", None, 2_000_000, (16, 104)),
    ("bfloat16", jnp.float32, 1_000_000, (8, 72)),
  ],
  ids=str,
)
def test_memory_budget_groups_chunks(
  rng, monkeypatch, impl, grad_mode, dtype, logits_dtype, budget, plan, mask
):
  """Groups of several chunks, both clamped at the end (300 rows), with
  ``dweight`` in place (a rounding per group).

  Without a mask every group runs whole (one dweight matmul a group; the
  clamped last one's first chunk owns 4 rows). With one, the group where the
  compacted valid rows end runs as one window of its chunks holding them
  (logits in the compute dtype, overwritten in place) or chunk by chunk
  (float32 logits of bfloat16 inputs, gathered into a group buffer). The
  plan is read off the sweep that runs.
  """
  plans = []

  def recorded(sweep, *args):
    plans.append((sweep.order.rows_per_chunk, sweep.order.rows_per_group))
    return gradient_sweep(sweep, *args)

  monkeypatch.setattr(_row_chunks, "gradient_sweep", recorded)
  problem = make_problem(rng, (300,), dtype=dtype, mask=mask, bias=True)
  check_against_oracle(
    problem,
    dtype,
    impl=impl,
    memory_budget=budget,
    logits_dtype=logits_dtype,
    accum_dtype=jnp.dtype(dtype),
    grad_mode=grad_mode,
    # dweight and dbias rounded in bfloat16 once per group (3): up to 1.4x
    # and 4x the naive head's error.
    naive_factor={**NAIVE_FACTOR, "dbias": 6.0},
    **ALL_OPTIONS,
  )
  assert plans and set(plans) == {plan}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float64_stays_float64(rng, impl, reduction):
  """float64 inputs are float64 throughout, the mean's 1/n included: the
  chunked path and the library's reference against the float64 oracle
  directly (the shared helpers read outputs through float32)."""
  problem = make_problem(rng, (97,), dim=16, vocab=1031, bias=True)
  with jax.enable_x64(True):
    args = [
      jnp.asarray(np.asarray(x, np.float64))
      for x in (problem.hidden, problem.weight, problem.bias)
    ]

    def run(fn, **kwargs):
      loss = lambda h, w, b: fn(
        h, w, problem.labels, b, where=problem.where, reduction=reduction, **kwargs
      )
      return jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)

    ref = run(oracle64.cross_entropy)
    # Groups of 32 rows in chunks of 8.
    for kwargs in (
      dict(impl=impl, memory_budget=1031 * 8 * 40),
      dict(impl="reference"),
    ):
      out = run(mst_jax.linear_cross_entropy, **kwargs)
      for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert got.dtype == jnp.float64
        err = np.max(np.abs(np.asarray(got) - np.asarray(want)))
        assert err <= 1e-12 * np.max(np.abs(np.asarray(want))), (kwargs, err)
