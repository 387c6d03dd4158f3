"""float16 gradients of a mean: formed from unit row weights, scaled in float32.

A mean over N tokens weights each row's gradient by ``1 / N``, and float16
ends at 6e-8: ``dlogits`` of ``p / N`` in float16 would flush to zero or keep
a few bits. The chunked paths form ``dlogits`` of unit row weights and apply
the scale in float32 where each product is rounded (``_plan.unit_weights``).

The oracle is written here from the definitions (``logits = h @ w.T + b``;
the mean over valid tokens of ``lse - logit[label]``; the mean log-probability
and entropy; the forward KL of the softmaxes) and differentiated in float64.
Each gradient's error is bounded by that of a naive head on the same float16
inputs: the same definitions in float32, differentiated by autodiff (float32
logits, the library's default for float16 inputs; logits rounded to the
library's ``logits_dtype`` in its forward where that is float16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_OPTIONS, make_problem, rel_err

import mst_jax
from mst_jax import _plan
from mst_jax._gemm.mosaic import gemm as mosaic_gemm

# A gradient's error against float64, at most this times the naive head's.
NAIVE_FACTOR = {"cross_entropy": 2.0, "log_probs": 2.0, "distillation": 2.0}
# Distillation's bound at N=4096, V=20000, D=64 (test_the_large_mean).
DISTILL_RTOL = 1e-2

# The shared problem: enough tokens that 1 / N flushes most of each row's
# float16 dlogits, unaligned sizes.
N_ROWS, VOCAB, DIM = 3001, 1031, 24
PALLAS_SIZES = (1000, 515)  # rows and columns in interpret mode (slow)

LOOPS = {
  "one_group": {},
  "chunks": dict(chunk_size=512),
  "groups": dict(memory_budget=2_000_000),  # ~11 groups of float32 logits
  "groups_float16_logits": dict(memory_budget=2_000_000, logits_dtype=jnp.float16),
  "vocab_blocks": dict(vocab_block_size=256),
}


# ---- The definitions, in any float dtype. ----


def _scores(hidden, weight, bias, layout, options, logits_dtype=None):
  """``softcap(h @ w.T + b)``; with ``logits_dtype``, the logits rounded to
  it in the forward (the gradient passes as if unrounded)."""
  w = weight.T if layout == "vd" else weight
  logits = hidden @ w + (0.0 if bias is None else bias)
  if logits_dtype is not None:
    rounding = logits.astype(logits_dtype).astype(logits.dtype) - logits
    logits = logits + jax.lax.stop_gradient(rounding)
  cap = options.get("logit_softcap")
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def _label_score(scores, labels):
  return jnp.take_along_axis(scores, labels[:, None], axis=-1)[:, 0]


def _mean(per_row, where):
  return jnp.sum(jnp.where(where, per_row, 0.0)) / jnp.sum(where)


def _cross_entropy(scores, labels, where, options):
  eps, zl = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)
  lse = jax.nn.logsumexp(scores, axis=-1)
  loss = (1 - eps) * (lse - _label_score(scores, labels))
  loss = loss + eps * (lse - jnp.mean(scores, axis=-1)) + zl * lse**2
  return _mean(loss, where)


def _log_probs(scores, labels, where, options):
  """The mean log-probability plus a tenth of the mean entropy."""
  del options
  log_p = jax.nn.log_softmax(scores, axis=-1)
  entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
  return _mean(_label_score(log_p, labels), where) + 0.1 * _mean(entropy, where)


def _forward_kl(scores, teacher_scores, where):
  log_q = jax.nn.log_softmax(scores, axis=-1)
  log_p = jax.nn.log_softmax(teacher_scores, axis=-1)
  return _mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1), where)


def _definition(kind, problem, layout, options, compute, teacher=None, **rounding):
  """The loss of ``(hidden, weight, bias)`` by the definitions, computed in
  ``compute``."""
  labels = problem.labels
  where = jnp.ones(labels.shape, bool) if problem.where is None else problem.where

  def loss(hidden, weight, bias):
    up = lambda x: x.astype(compute)
    scores = _scores(up(hidden), up(weight), up(bias), layout, options, **rounding)
    if kind == "distillation":
      teacher_scores = _scores(*map(up, teacher), None, layout, {})
      return _forward_kl(scores, teacher_scores, where)
    per_kind = {"cross_entropy": _cross_entropy, "log_probs": _log_probs}
    return per_kind[kind](scores, labels, where, options)

  return loss


def _float64_grads(kind, problem, layout, options, teacher=None):
  with jax.enable_x64(True):
    up = lambda x: jnp.asarray(np.asarray(x, np.float64))
    teacher = None if teacher is None else tuple(map(up, teacher))
    loss = _definition(kind, problem, layout, options, jnp.float64, teacher)
    args = (problem.hidden, problem.weight, problem.bias)
    return [np.asarray(g) for g in jax.grad(loss, (0, 1, 2))(*map(up, args))]


def _naive_grads(kind, problem, layout, options, teacher=None, logits_dtype=None):
  rounding = (
    {} if logits_dtype in (None, jnp.float32) else {"logits_dtype": logits_dtype}
  )
  loss = _definition(kind, problem, layout, options, jnp.float32, teacher, **rounding)
  return jax.grad(loss, (0, 1, 2))(problem.hidden, problem.weight, problem.bias)


def _chunked(kind, problem, layout, options, teacher=None, **perf):
  """``mst_jax``'s loss of ``(hidden, weight, bias)`` for ``kind``."""
  labels, where = problem.labels, problem.where
  kw = dict(where=where, weight_layout=layout, **perf)

  def loss(hidden, weight, bias):
    if kind == "cross_entropy":
      return mst_jax.linear_cross_entropy(hidden, weight, labels, bias, **kw, **options)
    if kind == "log_probs":
      log_p, entropy = mst_jax.linear_log_probs(
        hidden, weight, labels, bias, return_entropy=True, **kw
      )
      counted = jnp.ones(labels.shape, bool) if where is None else where
      return _mean(log_p, counted) + 0.1 * _mean(entropy, counted)
    return mst_jax.linear_distillation_loss(
      hidden, weight, *teacher, student_bias=bias, **kw
    )

  return loss


def check_float16(
  kind, problem, layout, options=None, teacher=None, factor=None, extra=0.0, **perf
):
  """Each of the three gradients within ``factor`` (default ``NAIVE_FACTOR``)
  times the naive head's error against the float64 definitions, plus
  ``extra`` (relative); returns the errors ``{name: (error, naive error)}``."""
  options, factor = options or {}, factor or NAIVE_FACTOR[kind]
  ref = _float64_grads(kind, problem, layout, options, teacher)
  naive = _naive_grads(
    kind, problem, layout, options, teacher, logits_dtype=perf.get("logits_dtype")
  )
  loss = _chunked(kind, problem, layout, options, teacher, **perf)
  args = (problem.hidden, problem.weight, problem.bias)
  grads = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
  errors = {}
  names = ("dhidden", "dweight", "dbias")
  for name, got, base, want in zip(names, grads, naive, ref, strict=True):
    assert got.dtype == jnp.float16, name
    assert np.isfinite(np.asarray(got, np.float32)).all(), name
    errors[name] = (rel_err(got, want), rel_err(base, want))
    bound = factor * errors[name][1] + extra
    assert errors[name][0] <= bound, (name, errors[name])
  return errors


def _problem(rng, layout, mask, n_rows=N_ROWS, vocab=VOCAB, dim=DIM, impl="xla"):
  if impl == "pallas":  # interpret mode on the CPU: slow
    n_rows, vocab = PALLAS_SIZES
  return make_problem(
    rng, (n_rows,), dim, vocab, "float16", mask=mask, bias=True, weight_layout=layout
  )


def _teacher(rng, layout, n_rows=N_ROWS, vocab=VOCAB, dim=40, impl="xla"):
  if impl == "pallas":
    n_rows, vocab = PALLAS_SIZES
  hidden = rng.standard_normal((n_rows, dim))
  weight = rng.standard_normal((vocab, dim)) * 4.0 / np.sqrt(dim)
  weight = weight if layout == "vd" else weight.T
  return jnp.asarray(hidden, jnp.float16), jnp.asarray(weight, jnp.float16)


# ---- The shared suite: every mode, backend, loop order and layout. ----


@pytest.mark.parametrize("options", [{}, ALL_OPTIONS], ids=["plain", "options"])
@pytest.mark.parametrize("mask", ["scattered", "none"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_cross_entropy_mean(rng, impl, grad_mode, loop, layout, mask, options):
  problem = _problem(rng, layout, mask, impl=impl)
  perf = dict(impl=impl, grad_mode=grad_mode, **LOOPS[loop])
  check_float16("cross_entropy", problem, layout, options, **perf)


@pytest.mark.parametrize("mask", ["scattered", "none"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("grad_mode", [None, "recompute"])
def test_log_probs_mean(rng, impl, grad_mode, loop, layout, mask):
  """The mean log-probability and entropy: per-row cotangents of the loss
  and the entropy, through the kept logits (None) or recomputed ones."""
  problem = _problem(rng, layout, mask, impl=impl)
  perf = dict(impl=impl, grad_mode=grad_mode, **LOOPS[loop])
  check_float16("log_probs", problem, layout, **perf)


@pytest.mark.parametrize("mask", ["scattered", "none"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("chunk_size", [None, 512])
def test_distillation_mean(rng, impl, grad_mode, chunk_size, layout, mask):
  problem = _problem(rng, layout, mask, impl=impl)
  teacher = _teacher(rng, layout, impl=impl)
  perf = dict(impl=impl, grad_mode=grad_mode, chunk_size=chunk_size)
  check_float16("distillation", problem, layout, teacher=teacher, **perf)


@pytest.mark.parametrize("vocab", [1024, 1001])
@pytest.mark.parametrize(
  "kind, perf",
  [
    ("cross_entropy", dict(grad_mode="fused")),
    ("cross_entropy", dict(grad_mode="recompute", chunk_size=512)),
    ("cross_entropy", dict(vocab_block_size=256)),
    ("log_probs", {}),
    ("distillation", {}),
  ],
  ids=str,
)
def test_the_hopper_program(rng, mosaic_on_cpu, monkeypatch, kind, perf, vocab):
  """The Mosaic GEMMs (an XLA product on the CPU) take float16 operands and
  write float32 products, which are scaled as they are rounded; the
  ``dweight`` accumulator is float32."""
  products = []
  gemm = mosaic_gemm.matmul

  def recorded(lhs, rhs, dims, out_dtype=None, **kwargs):
    products.append((jnp.dtype(lhs.dtype), jnp.dtype(out_dtype)))
    return gemm(lhs, rhs, dims, out_dtype, **kwargs)

  monkeypatch.setattr(mosaic_gemm, "matmul", recorded)
  problem = _problem(rng, "vd", "scattered", n_rows=1000, vocab=vocab, dim=128)
  teacher = _teacher(rng, "vd", n_rows=1000, vocab=vocab, dim=64)
  check_float16(kind, problem, "vd", teacher=teacher, impl="mosaic", **perf)
  assert products
  assert all(out == jnp.float32 for _, out in products), set(products)


# ---- Sums of unit gradients do not overflow float16. ----


@pytest.mark.parametrize(
  "perf",
  [
    {},
    dict(accum_dtype=jnp.float16),
    dict(vocab_block_size=32, chunk_size=1024),
    dict(accum_dtype=jnp.float16, grad_mode="recompute", chunk_size=1024),
  ],
  ids=str,
)
def test_unit_sums_do_not_overflow(rng, perf):
  """Every row labels one class with hidden states near 20: the unscaled sum
  of the label column's dweight over 8200 rows is about -164000, past
  float16's 65504; held in float32, or scaled as each float16 sum is
  rounded, the mean's gradient (about -20) is finite and accurate. A float16
  ``dweight`` or ``dbias`` rounds the partial sum of each chunk of rows (9
  here); every entry's terms share a sign, so the sums grow to the total and
  their roundings add at most (1 + 2 + ... + 9) / 9 = 5 half-ulps (2^-11) of
  it beyond the naive head's error (which can be a tiny fraction of that:
  seeds measured 4.2x and 5.7x it)."""
  n_rows, vocab, dim = 8200, 67, 16
  problem = make_problem(rng, (n_rows,), dim, vocab, "float16", mask="none", bias=True)
  problem.hidden = jnp.asarray(20.0 + rng.standard_normal((n_rows, dim)), jnp.float16)
  # The class every row scores lowest on average: p(label) near 0, so each
  # row adds about -20 to it (a class scored highest makes the gradient
  # vanish instead, float16 subnormals of 1e-5).
  scores = np.asarray(problem.weight, np.float64).sum(axis=1)
  problem.labels = jnp.full((n_rows,), np.argmin(scores), jnp.int32)
  in_place = "accum_dtype" in perf or "vocab_block_size" in perf
  check_float16(
    "cross_entropy", problem, "vd", extra=5 * 2.0**-11 if in_place else 0.0, **perf
  )


# ---- The scale itself, and what it leaves unchanged. ----


def test_only_float16_is_scaled():
  weights = (jnp.array([0.5, -4.0, 2.0]),)
  valid = jnp.array([True, False, True])
  for dtype in (jnp.bfloat16, jnp.float32, jnp.float64):
    assert not _plan.scales_gradients(dtype)
    assert _plan.unit_weights(weights, valid, dtype) == (weights, None)
  assert _plan.scales_gradients(jnp.float16)
  (unit,), scale = _plan.unit_weights(weights, valid, jnp.float16)
  # The largest magnitude at a valid row (the excluded -4 does not count).
  assert scale.dtype == jnp.float32 and float(scale) == 2.0
  np.testing.assert_array_equal(unit, [0.25, -2.0, 1.0])


def test_the_scale_of_no_weight_is_one():
  zeros = (jnp.zeros(4), jnp.zeros(4))
  units, scale = _plan.unit_weights(zeros, jnp.ones(4, bool), jnp.float16)
  assert float(scale) == 1.0
  assert all(not np.any(u) for u in units)


def test_float16_weights_plan_a_float32_accumulator():
  """Counted in the budget like one asked for: the rows get what it leaves."""
  n, v, d = 8192, 32000, 4096
  f16 = np.dtype(np.float16)
  assert _plan.default_accum_dtype(n, n, f16) == np.float32
  assert _plan.default_accum_dtype(n, n, np.dtype(jnp.bfloat16)) is None
  budget = 2 << 30
  kwargs = dict(memory_budget=budget, logits_dtype=np.dtype(np.float32))
  chunk, group, accum = _plan.plan_with_accumulator(n, v, d, f16, f16, **kwargs)
  assert accum == np.float32
  rest = budget - (4 - 2) * v * d
  assert (chunk, group) == _plan.plan_chunks(
    n, v, f16, memory_budget=rest, logits_dtype=np.dtype(np.float32)
  )


# ---- The case of the limitation, at full size. ----


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["scattered", "none"])
def test_the_large_mean(rng, mask):
  """N=4096 tokens, V=20000, D=64, logits of standard deviation ~3, the XLA
  path: cross-entropy and log-probs within 2x the naive head's error,
  distillation within 1e-2."""
  n, vocab, dim = 4096, 20000, 64
  problem = _problem(rng, "vd", mask, n_rows=n, vocab=vocab, dim=dim)
  teacher = _teacher(rng, "vd", n_rows=n, vocab=vocab, dim=dim)
  for kind in ("cross_entropy", "log_probs", "distillation"):
    errors = check_float16(kind, problem, "vd", teacher=teacher, impl="xla")
    if kind == "distillation":
      assert all(err <= DISTILL_RTOL for err, _ in errors.values()), errors
