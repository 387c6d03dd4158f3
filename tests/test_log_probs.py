"""``linear_log_probs`` against the float64 oracle written from the definitions.

The oracle (tests/oracle.py) forms the full logits in float64, takes
``log_softmax`` at the label and ``-sum p log p``, and differentiates
``sum(g_lp * log_probs + g_h * entropy)`` for random cotangents on both
outputs by autodiff: it shares no code with the library (which computes the
entropy as ``lse - E``). bfloat16 heads' gradients are held to the naive
bfloat16 head's error on the same problem.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import (
  LOOP_ORDERS,
  NAIVE_FACTOR,
  NAIVE_FLOOR,
  make_problem,
  matmul_shapes,
  rounded,
  to64,
)

import mst_jax

# The quick run takes every value of every parameter here (conftest._mark_slow).
EVERY_VALUE_QUICKLY = True

# Outputs: float32 math on float32 logits; bf16 inputs get float32 logits
# here (the default bfloat16 logits are checked with their rounding below).
_OUT_TOL = {"float32": 2e-5, "bfloat16": 2e-5}
_GRAD_TOL = {"float32": 2e-4}
# bfloat16 logits' outputs: within this multiple of the naive head's error.
OUT_FACTOR = 1.25


def _oracle(problem, g_lp, g_h, *, weight_layout, shift, scale, softcap, naive=None):
  """float64 ``(log_probs, entropy)`` and the gradients of the cotangents' sum.

  ``naive``: a dtype to round the logits to (computed as a naive head does:
  in the inputs' dtype, accumulated in float32), for that head's values and
  gradients instead of the exact ones.
  """
  argnums = (0, 1, 2) if problem.bias is not None else (0, 1)
  options = dict(
    where=problem.where, logit_scale=scale, logit_softcap=softcap, shift=shift
  )

  def outputs(hidden, weight, bias=None):
    if naive is None:
      return oracle64.log_probs(
        hidden,
        weight,
        problem.labels,
        bias,
        weight_layout=weight_layout,
        return_entropy=True,
        **options,
      )
    contract = 1 if weight_layout == "vd" else 0
    dims = (((hidden.ndim - 1,), (contract,)), ((), ()))
    logits = jax.lax.dot_general(
      hidden, weight, dims, preferred_element_type=jnp.float32
    )
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    return oracle64.log_probs_of_logits(
      rounded(logits, naive), problem.labels, return_entropy=True, **options
    )

  with jax.enable_x64(True):
    inputs = (problem.hidden, problem.weight, problem.bias)[: len(argnums)]
    args = inputs if naive else [jnp.asarray(to64(x)) for x in inputs]
    lp, h = outputs(*args)

    def total(*a):
      lp, h = outputs(*a)
      return jnp.sum(lp * g_lp) + jnp.sum(h * g_h)

    grads = jax.grad(total, argnums=argnums)(*args)
    return np.asarray(lp), np.asarray(h), [to64(g) for g in grads]


def _check_grads(problem, grads, ref_grads, g_lp, g_h, **head):
  """float32 gradients within ``_GRAD_TOL``; bfloat16 ones within
  ``NAIVE_FACTOR`` x the naive bfloat16 head's error, gradient by gradient."""
  names = ("dhidden", "dweight", "dbias")
  dtype = np.dtype(problem.hidden.dtype).name
  if dtype != "bfloat16":
    for name, g, ref in zip(names, grads, ref_grads, strict=False):
      assert _rel(g, ref) < _GRAD_TOL[dtype], (name, _rel(g, ref))
    return
  _, _, naive = _oracle(problem, g_lp, g_h, naive=jnp.bfloat16, **head)
  for name, g, ref, n in zip(names, grads, ref_grads, naive, strict=False):
    allowed = NAIVE_FACTOR[name] * _rel(n, ref) + NAIVE_FLOOR
    assert _rel(g, ref) <= allowed, (name, _rel(g, ref), allowed)


def _run(problem, g_lp, g_h, return_entropy, **kwargs):
  argnums = (0, 1, 3) if problem.bias is not None else (0, 1)

  def outputs(hidden, weight, labels, bias):
    return mst_jax.linear_log_probs(
      hidden,
      weight,
      labels,
      bias,
      where=problem.where,
      return_entropy=return_entropy,
      **kwargs,
    )

  def total(*args):
    out = outputs(*args)
    lp, h = out if return_entropy else (out, jnp.zeros_like(out))
    return jnp.sum(lp * g_lp) + jnp.sum(h * g_h)

  out = jax.jit(outputs)(*problem.args)
  grads = jax.jit(jax.grad(total, argnums=argnums))(*problem.args)
  return out, grads


def _rel(out, ref):
  out, ref = np.asarray(jnp.asarray(out, jnp.float32), np.float64), np.asarray(ref)
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("loop_order", list(LOOP_ORDERS))
@pytest.mark.parametrize(
  "mask, shift, bias, scale, softcap, weight_layout, dtype",
  [
    ("scattered", False, False, None, None, "vd", "float32"),
    ("prefix", True, True, 0.7, None, "dv", "bfloat16"),
    ("none", False, True, None, 4.0, "dv", "float32"),
    ("scattered", True, False, 1.5, 6.0, "vd", "bfloat16"),
  ],
)
def test_log_probs_and_entropy_match_the_oracle(
  rng, impl, loop_order, mask, shift, bias, scale, softcap, weight_layout, dtype
):
  problem = make_problem(
    rng, (3, 29), dtype=dtype, mask=mask, bias=bias, weight_layout=weight_layout
  )
  g_lp = rng.standard_normal(problem.labels.shape)
  g_h = rng.standard_normal(problem.labels.shape)
  options = dict(
    weight_layout=weight_layout,
    shift=shift,
    logit_scale=scale,
    logit_softcap=softcap,
    chunk_size=32,
    logits_dtype=jnp.float32,
    **LOOP_ORDERS[loop_order],
  )
  (lp, h), grads = _run(problem, g_lp, g_h, True, impl=impl, **options)
  ref_lp, ref_h, ref_grads = _oracle(
    problem,
    g_lp,
    g_h,
    weight_layout=weight_layout,
    shift=shift,
    scale=scale,
    softcap=softcap,
  )
  assert lp.shape == h.shape == problem.labels.shape
  assert lp.dtype == h.dtype == jnp.float32
  assert _rel(lp, ref_lp) < _OUT_TOL[dtype], _rel(lp, ref_lp)
  assert _rel(h, ref_h) < _OUT_TOL[dtype], _rel(h, ref_h)
  excluded = ref_lp == 0.0
  assert np.all(np.asarray(lp)[excluded] == 0.0)
  assert np.all(np.asarray(h)[excluded] == 0.0)
  assert all(g.dtype == problem.hidden.dtype for g in grads)
  head = dict(weight_layout=weight_layout, shift=shift, scale=scale, softcap=softcap)
  _check_grads(problem, grads, ref_grads, g_lp, g_h, **head)


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
def test_log_probs_alone_on_every_backend(rng, impl):
  """Without the entropy every backend computes log-probs (Pallas included)."""
  problem = make_problem(rng, (2, 37), dtype="float32", bias=True)
  g_lp = rng.standard_normal(problem.labels.shape)
  zeros = np.zeros(problem.labels.shape)
  kwargs = {} if impl == "reference" else {"chunk_size": 16}
  lp, grads = _run(problem, g_lp, zeros, False, impl=impl, **kwargs)
  ref_lp, _, ref_grads = _oracle(
    problem, g_lp, zeros, weight_layout="vd", shift=False, scale=None, softcap=None
  )
  assert _rel(lp, ref_lp) < 2e-5
  for g, ref in zip(grads, ref_grads, strict=True):
    assert _rel(g, ref) < 2e-4


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize(
  "mask, bias, dtype, weight_layout",
  [("scattered", True, "float32", "vd"), ("prefix", False, "bfloat16", "dv")],
)
def test_kept_logits_match_the_oracle(rng, impl, mask, bias, dtype, weight_layout):
  """By default all rows' logits fit one group here: the forward keeps them
  and the backward has no logits matmul of its own (3 matmuls in the
  program: logits, dhidden, dweight), with the oracle's gradients."""
  problem = make_problem(
    rng, (3, 29), dtype=dtype, mask=mask, bias=bias, weight_layout=weight_layout
  )
  g_lp = rng.standard_normal(problem.labels.shape)
  g_h = rng.standard_normal(problem.labels.shape)
  options = dict(weight_layout=weight_layout, impl=impl, logits_dtype=jnp.float32)
  if dtype == "bfloat16":  # bf16 logits: dlogits overwrite them
    options["logits_dtype"] = None
  (lp, h), grads = _run(problem, g_lp, g_h, True, **options)
  ref_lp, ref_h, ref_grads = _oracle(
    problem,
    g_lp,
    g_h,
    weight_layout=weight_layout,
    shift=False,
    scale=None,
    softcap=None,
  )
  head = dict(weight_layout=weight_layout, shift=False, scale=None, softcap=None)
  if options["logits_dtype"]:
    assert _rel(lp, ref_lp) < 2e-5 and _rel(h, ref_h) < 2e-5
  else:  # bfloat16 logits: the outputs round as the naive head's do
    naive_lp, naive_h, _ = _oracle(problem, g_lp, g_h, naive=jnp.bfloat16, **head)
    for out, ref, naive in ((lp, ref_lp, naive_lp), (h, ref_h, naive_h)):
      allowed = OUT_FACTOR * _rel(naive, ref) + NAIVE_FLOOR
      assert _rel(out, ref) <= allowed, (_rel(out, ref), allowed)
  _check_grads(problem, grads, ref_grads, g_lp, g_h, **head)

  def matmuls(**kwargs):
    def total(hidden, weight):
      lp, h = mst_jax.linear_log_probs(
        hidden,
        weight,
        problem.labels,
        where=problem.where,
        return_entropy=True,
        **options,
        **kwargs,
      )
      return jnp.sum(lp) + jnp.sum(h)

    return len(matmul_shapes(jax.grad(total, (0, 1)), problem.hidden, problem.weight))

  # The recompute program has its logits matmul in every chunk's branch.
  assert matmuls() == 3 and matmuls(grad_mode="recompute") > 3


def test_default_bf16_logits_round_like_a_bf16_head(rng):
  """Default bfloat16 logits: each output moves by at most the rounding of
  the row's largest logit (twice: lse and the label's score)."""
  problem = make_problem(rng, (4, 33), dtype="bfloat16", mask="none")
  lp, h = mst_jax.linear_log_probs(*problem.args, return_entropy=True)
  zeros = np.zeros(problem.labels.shape)
  ref_lp, ref_h, _ = _oracle(
    problem, zeros, zeros, weight_layout="vd", shift=False, scale=None, softcap=None
  )
  logits = to64(problem.hidden) @ to64(problem.weight).T
  bound = 2 * 2.0**-8 * np.abs(logits).max(axis=-1) + 1e-5
  assert np.all(np.abs(np.asarray(lp, np.float64) - ref_lp) <= bound)
  assert np.all(np.abs(np.asarray(h, np.float64) - ref_h) <= 2 * bound)


def test_log_probs_are_minus_the_unreduced_loss(rng):
  problem = make_problem(rng, (41,), dtype="float32")
  lp = mst_jax.linear_log_probs(*problem.args, where=problem.where)
  loss = mst_jax.linear_cross_entropy(
    *problem.args, where=problem.where, reduction="none"
  )
  np.testing.assert_array_equal(np.asarray(lp), -np.asarray(loss))


def test_banned_tokens_give_finite_entropy(rng):
  """A bias of -inf on a whole vocabulary block: no mass there, no NaN."""
  problem = make_problem(rng, (2, 19), dtype="float32", mask="none", bias=True)
  vocab = problem.weight.shape[0]
  bias = jnp.where(jnp.arange(vocab) < 300, -jnp.inf, problem.bias)
  labels = jnp.maximum(problem.labels, 300)
  args = (problem.hidden, problem.weight, labels, bias)
  for impl, loop in itertools.product(["xla", "pallas"], LOOP_ORDERS.values()):
    lp, h = mst_jax.linear_log_probs(
      *args, return_entropy=True, impl=impl, chunk_size=16, **loop
    )
    assert np.isfinite(np.asarray(lp)).all() and np.isfinite(np.asarray(h)).all()


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_out_of_range_label_is_nan(rng, impl):
  """Its log-prob is NaN; its entropy, which does not read the label, is the
  row's, on the chunked path and the oracle alike."""
  problem = make_problem(rng, (7,), dtype="float32", mask="none")
  labels = problem.labels.at[3].set(problem.weight.shape[0])
  lp, entropy = mst_jax.linear_log_probs(
    problem.hidden, problem.weight, labels, impl=impl, return_entropy=True
  )
  assert np.isnan(np.asarray(lp)[3]) and np.isfinite(np.delete(np.asarray(lp), 3)).all()
  logits = to64(problem.hidden) @ to64(problem.weight).T
  log_p = logits - logits.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  want = -(np.exp(log_p) * log_p).sum(-1)
  # The entropy is formed as lse - E[s]: its absolute error is a few float32
  # roundings of the row's largest logit (docs/limitations.md), which a
  # nearly certain row's small entropy cannot hide in a relative tolerance.
  rounding = 8 * np.finfo(np.float32).eps * np.abs(logits).max(-1)
  assert np.all(np.abs(np.asarray(entropy) - want) <= 1e-5 * want + rounding)


def test_bad_arguments_raise(rng):
  problem = make_problem(rng, (5,), dtype="float32")
  args = problem.args[:3]
  with pytest.raises(TypeError, match="return_entropy"):
    mst_jax.linear_log_probs(*args, return_entropy=1)
  with pytest.raises(NotImplementedError, match="fused"):
    mst_jax.linear_log_probs(*args, grad_mode="fused")
  with pytest.raises(ValueError, match="logit_scale"):
    mst_jax.linear_log_probs(*args, logit_scale=0.0)
  with pytest.raises(ValueError, match="logit_scale"):
    mst_jax.linear_log_probs(*args, logit_scale=float("inf"))
  with pytest.raises(TypeError, match="labels"):
    mst_jax.linear_log_probs(problem.hidden, problem.weight, problem.hidden[:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize(
  "return_entropy, dtype, vocab, tol, chunk_size, options",
  [
    (False, "float32", 5003, 3e-3, 256, {}),
    (True, "float32", 5003, 3e-3, 256, {}),
    # bfloat16 logits (the default): dlogits overwrite them in the backward,
    # recomputed in chunks, or (the default plan here) kept from the forward.
    (True, "bfloat16", 50257, 2e-2, 256, {}),
    (True, "bfloat16", 50257, 2e-2, None, {}),
    # Every option of linear_log_probs, kept logits, a masked prefix.
    (
      True,
      "bfloat16",
      32000,
      2e-2,
      None,
      dict(shift=True, scale=0.7, softcap=30.0, weight_layout="dv", mask="prefix"),
    ),
  ],
)
def test_log_probs_on_the_gpu(
  rng, return_entropy, dtype, vocab, tol, chunk_size, options
):
  """The default backend (the Pallas kernels, the entropy included),
  unaligned sizes, against the float64 oracle at the GPU's matmul precision."""
  options = dict(options)
  layout, mask = options.pop("weight_layout", "vd"), options.pop("mask", "scattered")
  shift, scale = options.pop("shift", False), options.pop("scale", None)
  softcap = options.pop("softcap", None)
  problem = make_problem(
    rng,
    (4, 301),
    dim=72,
    vocab=vocab,
    dtype=dtype,
    bias=True,
    weight_layout=layout,
    mask=mask,
  )
  g_lp = rng.standard_normal(problem.labels.shape)
  g_h = rng.standard_normal(problem.labels.shape) if return_entropy else 0 * g_lp
  out, grads = _run(
    problem,
    g_lp,
    g_h,
    return_entropy,
    chunk_size=chunk_size,
    weight_layout=layout,
    shift=shift,
    logit_scale=scale,
    logit_softcap=softcap,
  )
  lp, h = out if return_entropy else (out, None)
  ref_lp, ref_h, ref_grads = _oracle(
    problem,
    g_lp,
    g_h,
    weight_layout=layout,
    shift=shift,
    scale=scale,
    softcap=softcap,
  )
  assert _rel(lp, ref_lp) < tol
  if return_entropy:
    assert _rel(h, ref_h) < tol
  for g, ref in zip(grads, ref_grads, strict=True):
    assert _rel(g, ref) < tol
