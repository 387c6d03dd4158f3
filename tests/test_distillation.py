"""``linear_distillation_loss`` against a float64 full-logits oracle.

The oracle is tests/oracle.py's ``distillation`` on float64 inputs: both
heads' whole logits, the loss written from the definitions, gradients by
autodiff. It shares nothing with the library (neither the chunked path's
hand-written gradient, ``_math.distill``, nor its argument handling); a numpy
check pins its values to the formulas. Sizes are unaligned on purpose (N=37,
D_s=24, D_t=40, V=203) and chunks small (8 rows), so every problem has
several chunks, a clamped last one, and (valid rows compacted to the front)
chunks without a valid row. bfloat16 students' gradients are held to a
multiple of the naive bfloat16 heads' error on the same problem.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  NAIVE_FACTOR,
  NAIVE_FLOOR,
  assert_close,
  matmul_shapes,
  rounded,
  to64,
)

import mst_jax
from mst_jax import _plan
from mst_jax._sweep import distill as _distill_sweep

# The quick run takes every value of every parameter here (conftest._mark_slow).
EVERY_VALUE_QUICKLY = True

D_S, D_T, V = 24, 40, 203
CHUNK = 8
# ||out - ref|| <= rtol ||ref|| against the float64 oracle, by input dtype and
# logits dtype. float32: float32 math on float32 logits (T = 0.1 multiplies
# their rounding by 10). bfloat16 with float32 logits: dlogits and the
# gradients are rounded to bfloat16; with bfloat16 logits (the default), the
# logits too. bfloat16 gradients are held to the naive heads' error instead
# (check_grads_against_naive).
LOSS_RTOL = {"float32": 2e-5, "bfloat16": 2e-5, "bfloat16_logits": 1e-2}
GRAD_RTOL = {"float32": 5e-5}
# A divergence near 0 (T = 10) is a sum of terms P (log P - log Q) of
# log(V)'s size: its float32 error is relative to that, per token.
LOSS_ATOL_PER_TOKEN = 1e-6
PERF_OPTIONS = {f.name for f in dataclasses.fields(mst_jax.PerfOptions)}


@dataclasses.dataclass
class Pair:
  """A student and a teacher head on the same tokens."""

  student_hidden: jax.Array
  student_weight: jax.Array
  teacher_hidden: jax.Array
  teacher_weight: jax.Array
  labels: jax.Array | None
  where: jax.Array | None
  student_bias: jax.Array | None
  teacher_bias: jax.Array | None

  def call(self, fn, hidden, weight, bias, **kwargs):
    return fn(
      hidden,
      weight,
      self.teacher_hidden,
      self.teacher_weight,
      self.labels,
      student_bias=bias,
      teacher_bias=self.teacher_bias,
      where=self.where,
      **kwargs,
    )


def make_pair(
  rng,
  batch_shape=(37,),
  dtype="float32",
  *,
  layout="vd",
  mask="scattered",
  bias=None,
  labels=True,
  teacher_dtype=None,
  vocab=V,
) -> Pair:
  """Random heads whose logits have standard deviation ~3, the teacher's
  those of the student plus noise of standard deviation ~2 (related heads,
  as in distillation: the distributions overlap at every temperature).

  ``mask``: "none", "prefix" (the first third of each sequence is
  ``ignore_index``), "scattered" (``where`` drops ~40%) or "all". ``bias``:
  None, "finite", or "banned" (finite, and -inf at the same 7 columns of both
  heads).
  """
  n = int(np.prod(batch_shape))
  h_t = rng.standard_normal((*batch_shape, D_T))
  # The student sees a projection of the teacher's hidden states.
  projection = rng.standard_normal((D_T, D_S)) / np.sqrt(D_T)
  h_s = h_t @ projection
  w_s = rng.standard_normal((vocab, D_S)) * 3.0 / np.sqrt(D_S)
  noise = rng.standard_normal((vocab, D_T)) * 2.0 / np.sqrt(D_T)
  w_t = w_s @ projection.T + noise
  if layout == "dv":
    w_s, w_t = w_s.T, w_t.T
  y = rng.integers(0, vocab, batch_shape)
  where = None
  if mask == "prefix":
    y = np.where(np.arange(batch_shape[-1]) < batch_shape[-1] // 3, -100, y)
  elif mask == "scattered":
    where = rng.random(batch_shape) > 0.4
  elif mask == "all":
    where = np.zeros(batch_shape, bool)
  biases = [None, None]
  if bias is not None:
    biases = [rng.standard_normal(vocab) * 0.5 for _ in range(2)]
    if bias == "banned":
      banned = rng.choice(vocab, 7, replace=False)
      allowed = rng.choice(np.setdiff1d(np.arange(vocab), banned), y.shape)
      y = np.where(np.isin(y, banned), allowed, y)  # no label is banned
      for b in biases:
        b[banned] = -np.inf
  assert n == y.size
  cast = lambda x, d=dtype: None if x is None else jnp.asarray(x, d)
  teacher_dtype = teacher_dtype or dtype
  return Pair(
    cast(h_s),
    cast(w_s),
    cast(h_t, teacher_dtype),
    cast(w_t, teacher_dtype),
    jnp.asarray(y, jnp.int32) if labels else None,
    None if where is None else jnp.asarray(where),
    cast(biases[0]),
    cast(biases[1], teacher_dtype),
  )


def pair_args(pair):
  return pair.student_hidden, pair.student_weight, pair.student_bias


def value_and_grads(fn, pair: Pair, cotangent=None, **kwargs):
  """``(loss, grads, per_token)``: the loss (or, with a per-token
  ``cotangent``, ``sum(loss * cotangent)`` and the per-token losses) and its
  gradients with respect to the student's hidden, weight and (if any) bias,
  in one compiled program."""
  argnums = (0, 1, 2) if pair.student_bias is not None else (0, 1)

  @jax.jit
  def step(hidden, weight, bias):
    primals = (hidden, weight, bias)[: len(argnums)]
    extra = (bias,) if len(argnums) == 2 else ()
    per_token, vjp = jax.vjp(lambda *a: pair.call(fn, *a, *extra, **kwargs), *primals)
    seed = jnp.ones_like(per_token) if cotangent is None else cotangent
    loss = per_token if cotangent is None else jnp.sum(per_token * cotangent)
    return loss, vjp(seed.astype(per_token.dtype)), per_token

  loss, grads, per_token = step(*pair_args(pair))
  return loss, grads, None if cotangent is None else per_token


def _pair64(pair):
  """The pair's student hidden, weight, bias and teacher arrays, float64."""
  wide = lambda x: None if x is None else jnp.asarray(to64(x))
  return dataclasses.replace(
    pair,
    **{
      f.name: wide(getattr(pair, f.name))
      for f in dataclasses.fields(pair)
      if f.name not in ("labels", "where")
    },
  )


def oracle(pair: Pair, cotangent=None, **kwargs):
  """float64 values and gradients from tests/oracle.py."""
  kwargs = {k: v for k, v in kwargs.items() if k not in PERF_OPTIONS}
  with jax.enable_x64(True):
    p64 = _pair64(pair)
    c64 = None if cotangent is None else jnp.asarray(cotangent, jnp.float64)
    loss, grads, per_token = value_and_grads(oracle64.distillation, p64, c64, **kwargs)
    convert = lambda x: None if x is None else np.asarray(x)
    return convert(loss), [np.asarray(g) for g in grads], convert(per_token)


def naive_heads(
  student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, **kwargs
):
  """The distillation loss of naive heads: each head's logits ``hidden @
  weight.T`` in its dtype, accumulated in float32, plus its bias, rounded
  to that dtype (the loss in float64 from them, as ``conftest.naive_head``
  does); autodiff rounds the student's ``dlogits`` and gradients."""
  student_bias = kwargs.pop("student_bias", None)
  teacher_bias = kwargs.pop("teacher_bias", None)
  contract = 1 if kwargs.pop("weight_layout", "vd") == "vd" else 0

  def logits(hidden, weight, bias):
    dims = (((hidden.ndim - 1,), (contract,)), ((), ()))
    out = jax.lax.dot_general(hidden, weight, dims, preferred_element_type=jnp.float32)
    if bias is not None:
      out = out + bias.astype(jnp.float32)
    return rounded(out, hidden.dtype)

  return oracle64.distillation_of_logits(
    logits(student_hidden, student_weight, student_bias),
    logits(teacher_hidden, teacher_weight, teacher_bias),
    labels,
    **kwargs,
  )


def check(pair: Pair, tolerance: str, reduction="mean", **kwargs):
  """The chunked loss and gradients against the oracle (per-token outputs
  weighted by a random cotangent for ``reduction="none"``); a bfloat16
  student's gradients within ``NAIVE_FACTOR`` x the naive heads' error."""
  cotangent = None
  if reduction == "none":
    shape = pair.student_hidden.shape[:-1]
    cotangent = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
  kwargs = dict(reduction=reduction, **kwargs)
  ref_loss, ref_grads, ref_per_token = oracle(pair, cotangent, **kwargs)
  assert np.isfinite(ref_loss) and all(np.isfinite(g).all() for g in ref_grads)
  with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
    loss, grads, per_token = value_and_grads(
      mst_jax.linear_distillation_loss, pair, cotangent, **kwargs
    )
  assert loss.dtype == jnp.float32
  rtol = LOSS_RTOL[tolerance]
  n_tokens = np.prod(pair.student_hidden.shape[:-1])
  atol = LOSS_ATOL_PER_TOKEN * np.sqrt(n_tokens)
  assert_close(loss, ref_loss, rtol, "loss", atol=atol)
  if per_token is not None:
    assert per_token.shape == pair.student_hidden.shape[:-1]
    assert_close(per_token, ref_per_token, rtol, "per-token loss", atol=atol)
  names = ("dhidden", "dweight", "dbias")
  inputs = pair_args(pair)
  for name, x, g in zip(names, inputs, grads, strict=False):
    assert g.dtype == x.dtype, (name, g.dtype, x.dtype)
  if tolerance != "float32":
    options = {k: v for k, v in kwargs.items() if k not in PERF_OPTIONS}
    with jax.enable_x64(True):
      _, naive, _ = value_and_grads(naive_heads, pair, cotangent, **options)
    for name, g, ref, n in zip(names, grads, ref_grads, naive, strict=False):
      allowed = NAIVE_FACTOR[name] * np.linalg.norm(to64(n) - ref)
      floor = NAIVE_FLOOR * np.linalg.norm(ref)
      assert_close(
        g,
        ref,
        0.0,
        f"{name} (naive heads' error x{NAIVE_FACTOR[name]})",
        atol=allowed + floor,
      )
    return loss, grads
  for name, g, ref in zip(names, grads, ref_grads, strict=False):
    assert_close(g, ref, GRAD_RTOL[tolerance], name, atol=1e-7)
  return loss, grads


# Every divergence with every reduction, both layouts, each mask, shift,
# temperatures 0.1 and 10, the hard-label term, a finite or banned (-inf)
# bias, softcap and scale, and both gradient modes across them.
CASES = [
  # divergence, reduction, layout, mask, shift, options
  ("forward_kl", "mean", "vd", "scattered", False, {}),
  (
    "forward_kl",
    "sum",
    "dv",
    "prefix",
    True,
    dict(temperature=0.1, hard_label_weight=0.5, bias="banned"),
  ),
  (
    "forward_kl",
    "none",
    "vd",
    "none",
    False,
    dict(temperature=10.0, logit_softcap=4.0, logit_scale=0.7, labels=False),
  ),
  (
    "reverse_kl",
    "mean",
    "dv",
    "none",
    True,
    dict(temperature=10.0, bias="banned", grad_mode="recompute"),
  ),
  (
    "reverse_kl",
    "sum",
    "vd",
    "scattered",
    False,
    dict(hard_label_weight=1.0, logit_softcap=5.0, bias="finite"),
  ),
  ("reverse_kl", "none", "dv", "prefix", False, dict(temperature=0.1)),
  (
    "jsd",
    "mean",
    "dv",
    "prefix",
    True,
    dict(temperature=0.1, beta=0.3, logit_scale=1.5, grad_mode="recompute"),
  ),
  (
    "jsd",
    "sum",
    "vd",
    "none",
    False,
    dict(temperature=10.0, beta=0.7, bias="banned", hard_label_weight=0.3),
  ),
  ("jsd", "none", "vd", "scattered", True, dict(beta=0.5)),
]


@pytest.mark.parametrize("impl", [None, "pallas"], ids=["xla", "pallas"])
@pytest.mark.parametrize(
  "divergence, reduction, layout, mask, shift, options",
  CASES,
  ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES],
)
def test_matches_the_float64_oracle(
  rng, divergence, reduction, layout, mask, shift, options, impl
):
  """impl=None runs the XLA chunk on a CPU (the Pallas kernel on a GPU);
  "pallas" the kernel, in interpret mode on a CPU."""
  options = dict(options, impl=impl)
  bias, labels = options.pop("bias", None), options.pop("labels", True)
  batch = (3, 13) if mask == "prefix" or shift else (37,)
  pair = make_pair(rng, batch, layout=layout, mask=mask, bias=bias, labels=labels)
  check(
    pair,
    "float32",
    reduction,
    divergence=divergence,
    weight_layout=layout,
    shift=shift,
    chunk_size=CHUNK,
    **options,
  )


@pytest.mark.parametrize(
  "reduction, options",
  [
    ("mean", dict(divergence="jsd", hard_label_weight=0.5)),
    ("none", dict(divergence="reverse_kl", grad_mode="recompute")),
  ],
  ids=["jsd-mean", "reverse_kl-none"],
)
def test_transposed_weights_give_the_given_ones_gradients(
  rng, monkeypatch, reduction, options
):
  """``[D, V]`` weights transposed for the sweep (forced here on XLA's GEMMs,
  which run on any host; on a Hopper GPU at GPT-2's vocabulary): the loss,
  and ``dweight`` back in ``[D, V]``, against the float64 oracle; the
  copies come out of the memory budget."""
  planned = []  # (weight layout, memory budget) of each rows' plan
  plan_rows = _plan.rows_in_budget

  def recording_plan_rows(n_rows, per_row, budget):
    planned.append(budget)
    return plan_rows(n_rows, per_row, budget)

  monkeypatch.setattr(_distill_sweep, "transposes_weights", lambda *args: True)
  monkeypatch.setattr(_plan, "rows_in_budget", recording_plan_rows)
  pair = make_pair(rng, (3, 13), layout="dv", mask="prefix")
  check(pair, "float32", reduction, weight_layout="dv", memory_budget=10**6, **options)
  copies = 4 * (2 * D_S * V + D_T * V)  # float32
  # Planned once a call, with what the transposed copies leave.
  assert planned and set(planned) == {10**6 - copies}


def test_weights_are_transposed_only_within_half_the_budget(monkeypatch):
  """The copies (both weights and the student's gradient) may take at most
  half the memory budget; the rows are planned with the rest, unless given."""
  monkeypatch.setattr(_distill_sweep, "transposes_weights", lambda *args: True)
  zeros = lambda *s: jnp.zeros(s, jnp.bfloat16)
  v, d_s, d_t = 50257, 96, 160
  x = _distill_sweep.Heads(
    zeros(8, d_s), zeros(d_s, v), None, zeros(8, d_t), zeros(d_t, v), None, None, None
  )
  copies = 2 * (2 * d_s * v + d_t * v)
  flip = lambda budget: _distill_sweep.transposed(x, "dv", None, "xla", (), budget)
  for budget in (2 * copies - 2, 2 * copies - 1):
    assert flip(budget) is None
  heads, layout, budget = flip(2 * copies)
  assert (heads.weight.shape, heads.teacher_weight.shape) == ((v, d_s), (v, d_t))
  assert layout == "vd" and budget == copies


def test_biases_plan_their_float32_products_into_the_budget():
  """Each head's bias is added to its float32 product, held beside the
  chunk's 16-bit logits: with biases the planned chunks are smaller."""
  zeros = lambda *s: jnp.zeros(s, jnp.bfloat16)
  n, v, d = 8192, 32000, 128

  def chunk_rows(bias):
    b = zeros(v) if bias else None
    x = _distill_sweep.Heads(
      zeros(n, d), zeros(v, d), b, zeros(n, d), zeros(v, d), b, None, None
    )
    perf = mst_jax.PerfOptions(memory_budget=2**28)
    return _distill_sweep.resolve(x, None, perf, "vd").plan.rows_per_chunk

  assert chunk_rows(True) < chunk_rows(False)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [None, "pallas", "xla"], ids=str)
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_gpu_llama_vocabulary(rng, divergence, impl):
  """bfloat16 heads over the Llama-3 vocabulary on a GPU, with the default
  logits and accumulator in several planned chunks (and a masked tail); by
  default each chunk runs the Mosaic kernels on a Hopper GPU, with "pallas"
  the Triton kernel, both writing dlogits over the student's bfloat16
  logits."""
  pair = make_pair(
    rng, (2, 500), dtype="bfloat16", mask="prefix", bias="banned", vocab=128256
  )
  check(
    pair,
    "bfloat16_logits",
    divergence=divergence,
    temperature=2.0,
    hard_label_weight=0.5,
    memory_budget=256 << 20,
    impl=impl,
  )


@pytest.mark.gpu
@pytest.mark.parametrize(
  "divergence, reduction, options",
  [
    ("reverse_kl", "none", dict(temperature=0.5, logit_softcap=30.0)),
    ("jsd", "mean", dict(beta=0.2, logit_scale=0.8, hard_label_weight=0.2)),
    ("forward_kl", "sum", dict(temperature=0.1, grad_mode="recompute")),
  ],
)
def test_gpu_kernel_float32_dv_unaligned(rng, divergence, reduction, options):
  """The kernel on float32 heads (dlogits over the float32 student logits),
  a [D, V] weight, V = 50257 (a ragged last block) and 333-token sequences,
  with the options of each divergence; matmuls at float32 precision, so the
  float32 tolerances hold."""
  pair = make_pair(
    rng, (3, 333), layout="dv", mask="scattered", bias="finite", vocab=50257
  )
  with jax.default_matmul_precision("highest"):
    check(
      pair,
      "float32",
      reduction,
      divergence=divergence,
      weight_layout="dv",
      memory_budget=128 << 20,
      **options,
    )


@pytest.mark.parametrize(
  "divergence, logits_dtype, tolerance, options",
  [
    ("forward_kl", None, "bfloat16_logits", dict(accum_dtype=jnp.bfloat16)),
    ("jsd", jnp.float32, "bfloat16", dict(temperature=0.1, hard_label_weight=0.5)),
  ],
)
@pytest.mark.parametrize("impl", [None, "pallas"], ids=["xla", "pallas"])
def test_bfloat16_student_with_a_float32_teacher(
  rng, divergence, logits_dtype, tolerance, options, impl
):
  """With "pallas", the kernel reads bfloat16 student logits (dlogits over
  them, in place) or float32 ones (dlogits beside them) and float32 teacher
  logits."""
  pair = make_pair(rng, dtype="bfloat16", teacher_dtype="float32", bias="finite")
  check(
    pair,
    tolerance,
    divergence=divergence,
    logits_dtype=logits_dtype,
    chunk_size=CHUNK,
    impl=impl,
    **options,
  )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_valid_token_gives_exactly_zero(rng, reduction):
  pair = make_pair(rng, mask="all", bias="finite")
  cotangent = None if reduction == "mean" else np.ones(37, np.float32)
  loss, grads, _ = value_and_grads(
    mst_jax.linear_distillation_loss,
    pair,
    cotangent,
    reduction=reduction,
    hard_label_weight=1.0,
    chunk_size=CHUNK,
  )
  assert float(loss) == 0.0
  assert all(not np.any(np.asarray(g, np.float32)) for g in grads)


def test_the_oracle_follows_the_definitions(rng):
  """The oracle's per-token values, and the library's reference's, against
  numpy from the formulas, all in float64."""
  pair = make_pair(rng, mask="none")
  temperature, beta, weight = 2.0, 0.3, 0.4
  s = to64(pair.student_hidden) @ to64(pair.student_weight).T
  t = to64(pair.teacher_hidden) @ to64(pair.teacher_weight).T

  def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

  p, q = softmax(t / temperature), softmax(s / temperature)
  m = beta * p + (1 - beta) * q
  kl = lambda a, b: np.sum(a * np.log(a / b), axis=1)
  y = np.asarray(pair.labels)
  ce = -np.log(softmax(s)[np.arange(37), y])
  want = {
    "forward_kl": kl(p, q),
    "reverse_kl": kl(q, p),
    "jsd": beta * kl(p, m) + (1 - beta) * kl(q, m),
  }
  with jax.enable_x64(True):
    p64 = _pair64(pair)
    for fn in (oracle64.distillation, mst_jax.reference.linear_distillation_loss):
      for divergence, value in want.items():
        got = p64.call(
          fn,
          *pair_args(p64),
          divergence=divergence,
          beta=beta if divergence == "jsd" else 0.5,
          temperature=temperature,
          hard_label_weight=weight,
          reduction="none",
        )
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, value + weight * ce, rtol=1e-10)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_the_oracle_is_finite_where_probabilities_underflow(rng, divergence):
  """At T = 0.02 most probabilities underflow in float32 (some in float64);
  the divergences stay finite (the JSD below log 2): the oracle and the
  library's reference against numpy in log space, and the float32 reference
  against the oracle."""
  pair = make_pair(rng, mask="none")
  temperature, beta = 0.02, 0.3
  logits = [
    to64(h) @ to64(w).T / temperature
    for h, w in [
      (pair.teacher_hidden, pair.teacher_weight),
      (pair.student_hidden, pair.student_weight),
    ]
  ]
  log_p, log_q = (x - np.logaddexp.reduce(x, axis=1, keepdims=True) for x in logits)
  kl = lambda la, lb: np.sum(np.exp(la) * (la - lb), axis=1)
  log_m = np.logaddexp(np.log(beta) + log_p, np.log1p(-beta) + log_q)
  want = {
    "forward_kl": kl(log_p, log_q),
    "reverse_kl": kl(log_q, log_p),
    "jsd": beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m),
  }[divergence]
  assert np.isfinite(want).all() and (np.exp(log_q.astype(np.float32)) == 0).any()
  options = dict(
    divergence=divergence,
    beta=beta if divergence == "jsd" else 0.5,
    temperature=temperature,
    reduction="none",
  )
  with jax.enable_x64(True):
    p64 = _pair64(pair)
    for fn in (oracle64.distillation, mst_jax.reference.linear_distillation_loss):
      got = p64.call(fn, *pair_args(p64), **options)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
  cotangent = np.ones(want.shape, np.float32)
  loss, grads, _ = value_and_grads(
    mst_jax.reference.linear_distillation_loss, pair, cotangent, **options
  )
  ref_loss, ref_grads, _ = oracle(pair, cotangent, **options)
  assert_close(loss, ref_loss, 1e-4, "float32 reference")
  # Where every row is saturated (disjoint supports) the gradient is near 0
  # and made of O(1) terms that cancel: float32 math leaves about one rounding
  # of them, times 1 / T, in each row's dlogits, whatever the true gradient.
  floor = 4 * 2.0**-24 / temperature
  h, w = to64(pair.student_hidden), to64(pair.student_weight)
  atols = (
    floor * np.sqrt(h.shape[0]) * np.linalg.norm(w, axis=1).max(),  # dhidden
    floor * np.linalg.norm(h),  # dweight
  )
  for got_grad, ref_grad, atol in zip(grads, ref_grads, atols, strict=True):
    assert_close(got_grad, ref_grad, 1e-3, "float32 reference gradient", atol=atol)


@pytest.mark.parametrize("ignore_index", [0, 5, -100])
def test_without_labels_every_token_counts(rng, ignore_index):
  """``ignore_index`` excludes tokens by their label: without labels it
  excludes none, whatever its value."""
  pair = make_pair(rng, mask="none", labels=False)
  ref_loss, ref_grads, _ = oracle(pair)
  assert ref_loss > 0
  for fn, options in [
    (mst_jax.linear_distillation_loss, dict(chunk_size=CHUNK)),
    (mst_jax.reference.linear_distillation_loss, {}),
  ]:
    loss, grads, _ = value_and_grads(fn, pair, ignore_index=ignore_index, **options)
    assert_close(loss, ref_loss, LOSS_RTOL["float32"], "loss")
    for got_grad, ref_grad in zip(grads, ref_grads, strict=True):
      assert_close(got_grad, ref_grad, GRAD_RTOL["float32"], "gradient")


@pytest.mark.parametrize(
  "options",
  [dict(), dict(grad_mode="recompute"), dict(reduction="none"), dict(impl="reference")],
  ids=["fused", "recompute", "none", "reference"],
)
def test_no_matmul_forms_a_teacher_gradient(rng, options):
  """Differentiated with respect to every array, the program holds matmuls
  for the student's gradients and none with the teacher's hidden size D_t
  (a teacher ``dweight`` or ``dhidden``); the teacher's gradients are zero."""
  pair = make_pair(rng, bias="finite")
  if options.get("impl") != "reference":
    options = dict(options, chunk_size=CHUNK)

  def loss(*arrays):
    out = mst_jax.linear_distillation_loss(
      *arrays[:4], pair.labels, where=pair.where, **options
    )
    return jnp.sum(out)

  args = (
    pair.student_hidden,
    pair.student_weight,
    pair.teacher_hidden,
    pair.teacher_weight,
  )
  shapes = matmul_shapes(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)
  assert pair.student_weight.shape in shapes, shapes  # the student's dweight
  assert not [s for s in shapes if D_T in s], shapes
  frozen_weight = matmul_shapes(jax.grad(loss, argnums=0), *args)
  assert pair.student_weight.shape not in frozen_weight, frozen_weight
  if options.get("grad_mode") is None and options.get("impl") is None:
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    assert np.any(np.asarray(grads[1]))
    assert not np.any(np.asarray(grads[2])) and not np.any(np.asarray(grads[3]))


def test_fewer_rows_than_d_recompute_by_default(rng):
  """The fused mode's residual is a whole dweight: with fewer rows than D_s
  the default recomputes instead (both heads' logits formed again)."""
  pair = make_pair(rng, (16,), mask="none")

  def logits_matmuls(**options):
    loss = lambda h, w: mst_jax.linear_distillation_loss(
      h, w, pair.teacher_hidden, pair.teacher_weight, chunk_size=CHUNK, **options
    )
    shapes = matmul_shapes(jax.grad(loss, argnums=(0, 1)), *pair_args(pair)[:2])
    return sum(s == (CHUNK, V) for s in shapes)

  recompute = logits_matmuls(grad_mode="recompute")
  assert logits_matmuls() == recompute > logits_matmuls(grad_mode="fused")


def test_benchmark_case_computes_the_forward_kl():
  """The llama_distill case at a small size: the naive baselines and mst_jax
  compute the float64 oracle's mean forward KL."""
  from mst_jax.bench.cases import CASES, make_inputs, make_loss

  case = dataclasses.replace(
    CASES["llama_distill"], tokens=300, dim=24, teacher_dim=40, vocab=1031
  )
  case = dataclasses.replace(case, dtype="float32")
  hidden, weight, labels, where, teacher_hidden, teacher_weight = make_inputs(case)
  with jax.enable_x64(True):
    want = oracle64.distillation(
      hidden, weight, teacher_hidden, teacher_weight, where=where
    )
  for impl in ("naive", "naive_cast", "mst_jax:chunk_size=64"):
    got = make_loss(impl, case)(
      hidden, weight, labels, where, teacher_hidden, teacher_weight
    )
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, err_msg=impl)
  with jax.enable_x64(True):
    want = oracle64.distillation(
      hidden,
      weight,
      teacher_hidden,
      teacher_weight,
      labels,
      where=where,
      hard_label_weight=0.5,
    )
  got = make_loss("mst_jax:hard_label_weight=0.5", case)(
    hidden, weight, labels, where, teacher_hidden, teacher_weight
  )
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def _args(rng, **overrides):
  pair = make_pair(rng)
  args = dict(
    student_hidden=pair.student_hidden,
    student_weight=pair.student_weight,
    teacher_hidden=pair.teacher_hidden,
    teacher_weight=pair.teacher_weight,
    labels=pair.labels,
  )
  args.update(overrides)
  return args


BAD = [
  # (argument overrides, options, error, message)
  (dict(teacher_weight=np.ones((V + 1, D_T), np.float32)), {}, ValueError, "vocab"),
  (dict(teacher_weight=np.ones((V, D_T + 1), np.float32)), {}, ValueError, "teacher"),
  (dict(teacher_hidden=np.ones((36, D_T), np.float32)), {}, ValueError, "leading"),
  (dict(teacher_weight=np.ones((V, D_T), np.int32)), {}, TypeError, "teacher"),
  (dict(student_weight=np.ones((V, D_S), np.int32)), {}, TypeError, "student"),
  ({}, dict(divergence="jsd", beta=0.0), ValueError, "beta"),
  ({}, dict(divergence="jsd", beta=1.0), ValueError, "beta"),
  ({}, dict(divergence="jsd", beta=1.5), ValueError, "beta"),
  ({}, dict(divergence="forward_kl", beta=0.1), ValueError, "jsd"),
  ({}, dict(temperature=0.0), ValueError, "temperature"),
  ({}, dict(temperature=-1.0), ValueError, "temperature"),
  ({}, dict(temperature=float("inf")), ValueError, "temperature"),
  ({}, dict(temperature=float("nan")), ValueError, "temperature"),
  ({}, dict(hard_label_weight=-0.5), ValueError, "hard_label_weight"),
  (dict(labels=None), dict(hard_label_weight=0.5), ValueError, "needs labels"),
  ({}, dict(divergence="kl"), ValueError, "forward_kl"),
  ({}, dict(reduction="avg"), ValueError, "reduction"),
  ({}, dict(vocab_block_size=64), NotImplementedError, "chunk_size"),
  ({}, dict(reduction="none", grad_mode="fused"), NotImplementedError, "recompute"),
  ({}, dict(impl="reference", chunk_size=8), ValueError, "reference"),
  ({}, dict(temperature="1"), TypeError, "temperature"),
]


@pytest.mark.parametrize("overrides, options, error, match", BAD)
def test_bad_input_raises_at_trace_time(rng, overrides, options, error, match):
  args = _args(rng, **overrides)
  shapes = {
    k: None if v is None else jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
    for k, v in args.items()
  }
  with pytest.raises(error, match=match):  # eval_shape: tracing only
    jax.eval_shape(lambda a: mst_jax.linear_distillation_loss(**a, **options), shapes)


def test_plan_rows_splits_evenly():
  plan = _plan.rows_in_budget
  budget = 9 << 28
  assert plan(8192, 14 * 128256, budget) == 1024  # 8 chunks, not 7 of 1280
  assert plan(8192, 14 * 128256, 1 << 40) == 8192
  assert plan(37, 14 * 203, 14 * 203 * 20) == 8
  assert plan(37, 14 * 203, 1) == 8


def test_temporaries_grow_with_the_chunk_not_with_tokens(rng):
  """Compiled temporaries are O(chunk x V), never O(N x V)."""
  vocab, chunk = 4099, 64

  def temp_bytes(n_rows):
    shapes = [
      jax.ShapeDtypeStruct(s, jnp.float32)
      for s in ((n_rows, 16), (vocab, 16), (n_rows, 32), (vocab, 32))
    ]
    step = jax.value_and_grad(
      lambda *a: mst_jax.linear_distillation_loss(*a, chunk_size=chunk),
      argnums=(0, 1),
    )
    compiled = jax.jit(step).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(1024), temp_bytes(4096)
  full_logits = 4096 * vocab * 4
  assert large < full_logits / 8, (large, full_logits)
  assert large - small < 3072 * vocab * 4 / 16, (small, large)


def test_docstring_example_runs():
  result = doctest.testmod(importlib.import_module("mst_jax._losses.distillation"))
  assert result.attempted > 0 and result.failed == 0


KERNEL_OPTIONS = [
  dict(divergence="forward_kl"),
  dict(divergence="forward_kl", temperature=0.1, hard_label_weight=0.5),
  dict(divergence="reverse_kl", temperature=10.0, logit_softcap=5.0),
  dict(divergence="reverse_kl", logit_scale=1.5, hard_label_weight=1.0),
  dict(divergence="jsd", beta=0.3, temperature=0.5, logit_softcap=4.0),
  dict(divergence="jsd", beta=0.7, temperature=2.0, hard_label_weight=0.3),
]


def kernel_options(options: dict):
  """``KERNEL_OPTIONS``' dict as ``DistillOptions``."""
  from mst_jax._math.ce import CEOptions
  from mst_jax._math.distill import DistillOptions

  scores = {k: options[k] for k in ("logit_softcap", "logit_scale") if k in options}
  distill = {k: v for k, v in options.items() if k not in scores}
  return DistillOptions(**distill, scores=CEOptions(**scores))


def kernel_oracle(heads, labels, valid, g_loss, options):
  """Per-row losses and ``d sum(g_loss * loss) / d student`` of ``[R, V]``
  logits in float64 (tests/oracle.py's and its autodiff gradient; 0 at -inf
  logits). ``options``: the library's ``DistillOptions``, read as keywords."""
  keywords = dict(
    divergence=options.divergence,
    beta=options.beta,
    temperature=options.temperature,
    hard_label_weight=options.hard_label_weight,
    logit_scale=options.scores.logit_scale,
    logit_softcap=options.scores.logit_softcap,
  )
  with jax.enable_x64(True):
    s64, t64 = (jnp.asarray(to64(x)) for x in heads)

    def total(s):
      losses = oracle64.distillation_of_logits(
        s, t64, labels, where=np.asarray(valid), reduction="none", **keywords
      )
      return jnp.sum(losses * g_loss), losses

    grad, loss = jax.grad(total, has_aux=True)(s64)
    grad = jnp.where(jnp.isfinite(s64), grad, 0.0)
  return np.asarray(loss), np.asarray(grad)


def kernel_rtol(student, options: dict, base: float = 2e-5) -> float:
  """float32 math on tempered scores u = s / T rounds each u, and the row's
  max, by up to 2**-24 |u|: u - max by 2**-23 |u|, a relative error of that
  size in every probability (1.2e-3 at |u| = 1e4)."""
  student = to64(student)
  finite = np.abs(student[np.isfinite(student)]).max()
  magnitude = finite * options.get("logit_scale", 1.0) / options.get("temperature", 1.0)
  return base + 2.0**-23 * magnitude


@pytest.mark.parametrize("offset", [0.0, 1e3], ids=["plain", "offset"])
@pytest.mark.parametrize(
  "options", KERNEL_OPTIONS, ids=lambda o: "-".join(map(str, o.values()))
)
def test_kernel_blocks_merge_like_whole_rows(rng, options, offset):
  """The Pallas kernel (interpret mode) in 64-column blocks, the last one
  ragged, 2 rows a program over an odd number of rows, banned (-inf) columns
  and excluded rows: per-row losses and dlogits against the float64
  full-logits reference (``losses_from_logits`` and its autodiff gradient).
  ``offset`` adds 1e3 to every logit of both heads (without a softcap the
  loss does not change)."""
  from mst_jax._kernels.triton.common import KernelBlocks
  from mst_jax._kernels.triton.distill import PallasTritonDistill

  rows, vocab = 7, V
  student = rng.standard_normal((rows, vocab)) * 3.0
  teacher = student + rng.standard_normal((rows, vocab)) * 2.0
  banned = rng.choice(vocab, 5, replace=False)
  student[:, banned] = teacher[:, banned] = -np.inf
  if not (options.get("logit_softcap") or options.get("logit_scale")):
    student, teacher = student + offset, teacher + offset
  labels = rng.choice(np.setdiff1d(np.arange(vocab), banned), rows)
  labels[0] = vocab - 1 if vocab - 1 not in banned else labels[0]  # ragged block
  valid = np.array([True, True, False, True, True, False, True])
  g_loss = rng.standard_normal(rows)
  opts = kernel_options(options)
  kernel = PallasTritonDistill(
    blocks=KernelBlocks(block_rows=2, block_v=64), interpret=True
  )
  args = [jnp.asarray(x, jnp.float32) for x in (student, teacher)]
  loss, dlogits = kernel.chunk_loss(
    *args,
    jnp.asarray(labels, jnp.int32),
    jnp.asarray(valid),
    jnp.asarray(g_loss, jnp.float32),
    opts,
    jnp.float32,
  )
  ref_loss, ref_grad = kernel_oracle(args, labels, valid, g_loss, opts)
  rtol = kernel_rtol(student, options)
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(rows))
  assert_close(dlogits, ref_grad, rtol, "dlogits", atol=1e-7)
  assert np.all(np.asarray(dlogits)[~valid] == 0.0)
