"""The bug classes other fused LM heads shipped, as tests.

Each test names the report it guards against. Every implementation (the
``impl`` fixture: XLA, Pallas) and, where they differ, both loop orders and
gradient modes; float64 full-logits oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  ALL_OPTIONS,
  GRAD_RTOL,
  LOSS_RTOL,
  ON_GPU,
  assert_close,
  check_against_oracle,
  make_problem,
  oracle,
  rel_err,
  to64,
  value_and_grads,
)

import mst_jax


def _cotangent(kind: str, rng, shape):
  """A function of the per-token losses whose gradient is a per-token
  cotangent: random, strided (every third token) or a slice."""
  g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  if kind == "random":
    return lambda loss: jnp.sum(g.astype(loss.dtype) * loss)
  if kind == "strided":
    return lambda loss: jnp.sum(g[:, ::3].astype(loss.dtype) * loss[:, ::3])
  return lambda loss: jnp.sum(loss[1:3, 2:9])


@pytest.mark.parametrize("cotangent", ["random", "strided", "sliced"])
def test_per_token_gradients_for_any_cotangent(rng, impl, loop_order, cotangent):
  """reduction="none" differentiated through a weighted sum, a strided view
  or a slice of the losses (Liger #968, #678; verl #6960)."""
  problem = make_problem(rng, (4, 13), bias=True, mask="scattered")
  of_losses = _cotangent(cotangent, rng, (4, 13))

  def objective(fn, hidden, weight, bias, **kwargs):
    losses = fn(
      hidden,
      weight,
      problem.labels,
      bias,
      where=problem.where,
      reduction="none",
      **ALL_OPTIONS,
      **kwargs,
    )
    return of_losses(losses)

  step = jax.value_and_grad(objective, argnums=(1, 2, 3))
  args = (problem.hidden, problem.weight, problem.bias)
  fn = functools.partial(
    mst_jax.linear_cross_entropy, impl=impl, chunk_size=4, **loop_order
  )
  value, grads = jax.jit(functools.partial(step, fn))(*args)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(to64(x)) for x in args]
    ref, ref_grads = step(oracle64.cross_entropy, *args64)
    # A signed sum of the losses may cancel: each term's float32 error adds.
    ref_losses = oracle64.cross_entropy(
      *args64[:2],
      problem.labels,
      args64[2],
      where=problem.where,
      reduction="none",
      **ALL_OPTIONS,
    )
    terms = jax.grad(of_losses)(ref_losses) * ref_losses
  rtol = LOSS_RTOL["float32"] * 10
  atol = rtol * np.sum(np.abs(np.asarray(terms)))
  assert_close(value, np.asarray(ref), rtol, "value", atol=atol)
  for name, g, r in zip(("dhidden", "dweight", "dbias"), grads, ref_grads, strict=True):
    assert_close(g, np.asarray(r), GRAD_RTOL["float32"], name)


def test_per_token_weights_in_the_fused_mode(rng, impl, loop_order):
  """The fused mode's per-row scale: a sum weighted per token (the same
  gradient as a weighted sum of ``reduction="none"``)."""
  problem = make_problem(rng, (4, 13), bias=True, mask="scattered")
  token_weights = jnp.asarray(rng.random((4, 13)) + 0.1, jnp.float32)
  check_against_oracle(
    problem,
    "float32",
    impl=impl,
    chunk_size=4,
    reduction="sum",
    token_weights=token_weights,
    grad_mode="fused",
    **loop_order,
  )


def test_chunks_without_a_valid_label_between_sparse_ones(
  rng, impl, loop_order, grad_mode
):
  """Three valid tokens among 64, four-row chunks: most chunks hold none
  (unsloth #5230)."""
  problem = make_problem(rng, (64,), bias=True, mask="none")
  labels = np.full(64, -100)
  for position in (5, 40, 63):
    labels[position] = rng.integers(0, 1031)
  problem.labels = jnp.asarray(labels, jnp.int32)
  check_against_oracle(
    problem, "float32", impl=impl, chunk_size=4, grad_mode=grad_mode, **loop_order
  )


def test_gradient_accumulation_matches_the_whole_batch(rng, impl):
  """docs/api.md's recipe: each micro-batch's summed loss over the whole
  batch's valid count. Micro-batches with 0 and with many valid tokens."""
  problem = make_problem(rng, (6, 11), bias=True, mask="prefix")
  labels = np.asarray(problem.labels).copy()
  labels[:2] = -100  # the first micro-batch has no valid token
  problem.labels = jnp.asarray(labels)
  n_valid = jnp.sum(problem.labels != -100)

  def micro_loss(hidden, weight, bias, labels):
    loss = mst_jax.linear_cross_entropy(
      hidden, weight, labels, bias, reduction="sum", impl=impl, chunk_size=4
    )
    return loss / n_valid

  step = jax.jit(jax.value_and_grad(micro_loss, argnums=(0, 1, 2)))
  total, dweight, dbias, dhidden = 0.0, 0.0, 0.0, []
  for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
    loss, (dh, dw, db) = step(
      problem.hidden[rows], problem.weight, problem.bias, problem.labels[rows]
    )
    total, dweight, dbias = total + loss, dweight + dw, dbias + db
    dhidden.append(dh)
  problem.where = None
  ref_loss, ref = oracle(problem)
  assert_close(total, ref_loss, LOSS_RTOL["float32"] * 4, "loss")
  assert_close(jnp.concatenate(dhidden), ref[0], GRAD_RTOL["float32"], "dhidden")
  assert_close(dweight, ref[1], GRAD_RTOL["float32"], "dweight")
  assert_close(dbias, ref[2], GRAD_RTOL["float32"], "dbias")


def _dweight_errors(hidden, weight, labels, groups, **kwargs):
  """Relative dweight error of the naive head and of mst_jax with each
  number of row groups, against float64."""
  n_rows = hidden.shape[0]

  def naive(hidden, weight):
    logits = (hidden @ weight.T).astype(jnp.float32)
    target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

  def dweight(loss, h, w, **kw):
    return jax.jit(jax.grad(functools.partial(loss, **kw), argnums=1))(h, w)

  with jax.enable_x64(True):
    args64 = [jnp.asarray(to64(x)) for x in (hidden, weight)]
    ref = np.asarray(dweight(oracle64.cross_entropy, *args64, labels=labels))
  naive_error = rel_err(dweight(naive, hidden, weight), ref)
  errors = {}
  for count in groups:
    fn = functools.partial(mst_jax.linear_cross_entropy, labels=labels)
    out = dweight(fn, hidden, weight, chunk_size=n_rows // count, **kwargs)
    errors[count] = rel_err(out, ref)
  return naive_error, errors


def test_dweight_error_does_not_grow_with_row_groups(rng):
  """bfloat16, V = 256000: 1, 4, 16 and 64 row groups stay within 1.5x the
  naive head's dweight error (Liger #1391 grew 1.34x -> 7.31x).

  The groups are the loop order's, shared by the backends: the XLA one runs
  here (Pallas's interpret mode takes minutes at this V; the GPU test below
  runs its kernels). Against the naive head with float32 logits: XLA:CPU
  keeps a bfloat16 head's logits in float32 (it may skip roundings), so that
  is the naive head it runs.
  """
  n_rows, dim, vocab = 128, 16, 256000
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.5, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
  naive, errors = _dweight_errors(
    hidden, weight, labels, (1, 4, 16, 64), impl="xla", logits_dtype=jnp.float32
  )
  assert max(errors.values()) <= 1.5 * naive, (naive, errors)


@pytest.mark.gpu
def test_dweight_error_does_not_grow_with_row_groups_at_scale(rng):
  """The same at N = 131072 rows on a GPU whose allocator holds the one row
  group's 65 GiB of logits and statistics (an H200), 65536 on a smaller one
  (an H100 with JAX's default 75% of its memory). One row group is the naive
  head's computation (one matmul for the logits, one for dweight), so the
  others are held to 1.5x its error."""
  assert ON_GPU
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
  n_rows, dim, vocab = (131072 if limit > 80 * 2**30 else 65536), 64, 256000
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.25, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
  errors = {}
  for count in (1, 4, 16, 64):
    grad = jax.jit(
      jax.grad(
        functools.partial(
          mst_jax.linear_cross_entropy, labels=labels, chunk_size=n_rows // count
        ),
        argnums=1,
      )
    )
    # On the host before the next program runs: one row group's program holds
    # N x V logits and statistics, and programs dispatched ahead of it
    # would hold their own at the same time.
    errors[count] = to64(grad(hidden, weight))
  # float64 in row chunks: dweight = sum over rows of dlogits^T h / N.
  with jax.enable_x64(True):
    h64, w64 = (jnp.asarray(x, jnp.float64) for x in (hidden, weight))

    @jax.jit
    def chunk_dweight(h, y):
      logits = h @ w64.T
      dlogits = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(y, vocab)
      return dlogits.T @ h

    ref = sum(
      chunk_dweight(h64[i : i + 4096], labels[i : i + 4096])
      for i in range(0, n_rows, 4096)
    )
    ref = np.asarray(ref / n_rows)
  errors = {count: rel_err(g, ref) for count, g in errors.items()}
  # One group's own error, so that a wrong product (an error of ~1 in every
  # count, as a 64-wide output once stored zeros) cannot pass.
  assert errors[1] <= 2 * GRAD_RTOL["bfloat16"], errors
  assert max(errors.values()) <= 1.5 * errors[1], errors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_are_never_above_zero(rng, impl, dtype):
  """Labels at a dominant logit, whose probability rounds to 1 (verl #2899)."""
  n_rows, dim, vocab = 67, 16, 1031
  hidden = rng.standard_normal((n_rows, dim))
  weight = rng.standard_normal((vocab, dim))
  logits = hidden @ weight.T
  labels = np.argmax(logits, axis=-1)
  hidden, weight = (jnp.asarray(x * 4, dtype) for x in (hidden, weight))
  for kwargs in ({}, {"vocab_block_size": 256}):
    log_probs = mst_jax.linear_log_probs(
      hidden, weight, jnp.asarray(labels), impl=impl, chunk_size=8, **kwargs
    )
    assert float(jnp.max(log_probs)) <= 0.0
    # The labels are mostly dominant classes, p near 1 (the float64 argmax;
    # rounding the inputs may change a few).
    assert float(jnp.median(log_probs)) > -0.05


def test_a_large_common_logit_offset_changes_nothing(rng, impl, loop_order):
  """+1e4 through the bias: the float64 loss and gradients of the unshifted
  logits, to float32 rounding of 1e4-sized logits (ulp 2**-10)."""
  problem = make_problem(rng, (3, 13), bias=True, mask="scattered")
  ref_loss, ref_grads = oracle(problem)
  problem.bias = problem.bias + 1e4
  loss, grads = value_and_grads(
    mst_jax.linear_cross_entropy, problem, impl=impl, chunk_size=4, **loop_order
  )
  assert abs(float(loss) - float(ref_loss)) <= 4 * 2.0**-10
  for name, g, r in zip(("dhidden", "dweight", "dbias"), grads, ref_grads, strict=True):
    assert_close(g, r, 8e-3, name)


@pytest.mark.parametrize("masked", ["three", "forty_percent"])
def test_masked_tokens_keep_the_naive_dweight_error(rng, masked):
  """bfloat16, one row group of several chunks, tokens masked: three (every
  chunk still holds a valid row, so the group runs whole) or 40% at random
  (compacted, the valid rows end mid-group: the chunks holding them run as
  one window). Either way ``dweight`` is one matmul and one rounding in the
  weight's dtype: the naive head's error. Chunk by chunk it would take a
  rounding per chunk (1.45x and 1.9x the error here)."""
  n_rows, dim, vocab = 1000, 48, 1031
  hidden = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) * 0.2, jnp.bfloat16)
  labels = rng.integers(0, vocab, n_rows)
  if masked == "three":
    labels[rng.choice(n_rows, 3, replace=False)] = -100
  else:
    labels[rng.random(n_rows) < 0.4] = -100
  labels = jnp.asarray(labels, jnp.int32)

  def naive(hidden, weight):
    logits = (hidden @ weight.T).astype(jnp.float32)
    safe = jnp.maximum(labels, 0)
    target = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    loss = jax.nn.logsumexp(logits, axis=-1) - target
    return jnp.sum(jnp.where(labels >= 0, loss, 0.0)) / jnp.sum(labels >= 0)

  def dweight(loss, h, w):
    return jax.jit(jax.grad(loss, argnums=1))(h, w)

  with jax.enable_x64(True):
    ref = dweight(
      functools.partial(oracle64.cross_entropy, labels=labels),
      *(jnp.asarray(to64(x)) for x in (hidden, weight)),
    )
  chunked = functools.partial(mst_jax.linear_cross_entropy, labels=labels, impl="xla")
  error = rel_err(dweight(chunked, hidden, weight), np.asarray(ref))
  naive_error = rel_err(dweight(naive, hidden, weight), np.asarray(ref))
  assert error <= 1.2 * naive_error, (error, naive_error)
