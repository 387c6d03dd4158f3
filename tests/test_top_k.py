"""``linear_top_k`` against float64 full logits: the ids are a top k of the
float64 scores (within the logits' rounding), largest first, their
log-probs the float64 ``log_softmax`` there, and the gradient of the
log-probs (ids held fixed) the float64 one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GPU_LOSS_RTOL, to64

import mst_jax

# The quick run takes every value of every parameter here (conftest._mark_slow).
EVERY_VALUE_QUICKLY = True

# Relative to the float64 values' norm: float32 logits; bfloat16 ones (the
# default for bfloat16 inputs) round each logit by up to 2**-9 of it.
# bfloat16 gradients come back in bfloat16 (2**-9 each); a dropped term errs
# by about 1.
OUT_TOL = {"float32": 2e-6, "bfloat16_f32_logits": 2e-6, "bfloat16": 2e-2}
GRAD_TOL = {"float32": 2e-4, "bfloat16_f32_logits": 2e-2, "bfloat16": 5e-2}


def _scores64(hidden, weight, bias, weight_layout, logit_scale, logit_softcap):
  scale, softcap = logit_scale, logit_softcap
  w = to64(weight) if weight_layout == "dv" else to64(weight).T
  s = to64(hidden) @ w + (0.0 if bias is None else to64(bias))
  s = s * (1.0 if scale is None else scale)
  return s if softcap is None else softcap * np.tanh(s / softcap)


def _log_softmax64(s):
  m = s.max(-1, keepdims=True)
  return s - m - np.log(np.exp(s - m).sum(-1, keepdims=True))


def _check_selection(scores, log_probs, ids, tol):
  """``(log_probs, ids)`` against float64 ``scores``: the log-probs are the
  float64 ones at the ids, largest first, the ids distinct and a top k: no id
  left out scores above the kth taken, beyond the logits' rounding."""
  k = ids.shape[-1]
  ids64 = np.asarray(ids)
  want = np.take_along_axis(_log_softmax64(scores), ids64, -1)
  got = np.asarray(log_probs, np.float64)
  assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
  assert np.all(np.diff(got, axis=-1) <= 0)
  assert all(len(set(r)) == k for r in ids64.reshape(-1, k))
  kth = np.take_along_axis(scores, ids64, -1).min(-1)
  rest = scores.copy()
  np.put_along_axis(rest, ids64, -np.inf, -1)
  assert np.all(rest.max(-1) <= kth + tol * np.abs(scores).max() * 4)


CASES = [
  # dtype, logits_dtype, weight_layout, bias, k, options
  ("float32", None, "vd", True, 5, {}),
  ("float32", None, "dv", False, 1, {"chunk_size": 4, "logit_softcap": 3.0}),
  ("bfloat16", "float32", "vd", True, 8, {"chunk_size": 5, "logit_scale": 0.8}),
  ("bfloat16", None, "dv", True, 3, {"memory_budget": 4096}),
]


@pytest.mark.parametrize("dtype,logits_dtype,weight_layout,bias,k,options", CASES)
def test_top_k_matches_float64_logits(
  rng, dtype, logits_dtype, weight_layout, bias, k, options
):
  batch, dim, vocab = (2, 7), 24, 301
  hidden = jnp.asarray(rng.standard_normal((*batch, dim)), dtype)
  w = rng.standard_normal((vocab, dim)) * 2.0 / np.sqrt(dim)
  weight = jnp.asarray(w if weight_layout == "vd" else w.T, dtype)
  b = jnp.asarray(rng.standard_normal(vocab) * 0.3, dtype) if bias else None
  head = dict(
    logit_scale=options.get("logit_scale"), logit_softcap=options.get("logit_softcap")
  )
  kwargs = dict(bias=b, weight_layout=weight_layout, logits_dtype=logits_dtype)
  kwargs.update(options)
  log_probs, ids = mst_jax.linear_top_k(hidden, weight, k, **kwargs)
  assert log_probs.shape == ids.shape == (*batch, k) and ids.dtype == jnp.int32
  key = dtype + ("_f32_logits" if logits_dtype else "")

  scores = _scores64(hidden, weight, b, weight_layout, **head)
  _check_selection(scores, log_probs, ids, OUT_TOL[key])
  ids64 = np.asarray(ids)

  cot = rng.standard_normal(ids.shape)
  names = ["hidden", "weight", "bias"][: 3 if bias else 2]
  args = [hidden, weight, b][: len(names)]

  def total(*a):
    kw = dict(kwargs, bias=a[2] if bias else None)
    lp, _ = mst_jax.linear_top_k(a[0], a[1], k, **kw)
    return jnp.sum(lp * jnp.asarray(cot, lp.dtype))

  grads = jax.grad(total, argnums=tuple(range(len(args))))(*args)
  with jax.enable_x64(True):

    def total64(*a):
      w = a[1] if weight_layout == "dv" else a[1].T
      s = a[0] @ w + (a[2] if bias else 0.0)
      s = s * (head["logit_scale"] or 1.0)
      if head["logit_softcap"]:
        s = head["logit_softcap"] * jnp.tanh(s / head["logit_softcap"])
      lp = jnp.take_along_axis(jax.nn.log_softmax(s, -1), jnp.asarray(ids64), -1)
      return jnp.sum(lp * cot)

    ref = jax.grad(total64, argnums=tuple(range(len(args))))(
      *[jnp.asarray(to64(x)) for x in args]
    )
  for name, g, r in zip(names, grads, ref, strict=True):
    g, r = to64(g), np.asarray(r)
    assert np.linalg.norm(g - r) <= GRAD_TOL[key] * np.linalg.norm(r), name


def test_top_k_errors(rng):
  hidden = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  weight = jnp.asarray(rng.standard_normal((11, 8)), jnp.float32)
  with pytest.raises(ValueError, match="at most the vocabulary size 11"):
    mst_jax.linear_top_k(hidden, weight, 12)
  with pytest.raises(ValueError, match="k"):
    mst_jax.linear_top_k(hidden, weight, 0)
  with pytest.raises(TypeError, match="k"):
    mst_jax.linear_top_k(hidden, weight, 2.5)
  with pytest.raises(ValueError, match="weight's D axis"):
    mst_jax.linear_top_k(hidden, weight.T, 2)
  with pytest.raises(TypeError, match="weight_layot"):
    mst_jax.linear_top_k(hidden, weight, 2, weight_layot="dv")


@pytest.mark.parametrize("vocab,k", [(1537, 64), (1030, 17), (700, 128)])
def test_blocks_then_candidates_are_lax_top_k(rng, vocab, k):
  """The GPU's two-stage selection gives ``lax.top_k``'s values and ids,
  ties (repeated scores, -inf from a masking bias) included."""
  from mst_jax._losses import top_k

  scores = rng.standard_normal((37, vocab)).astype(np.float32)
  scores[:, rng.integers(0, vocab, 40)] = np.float32(rng.standard_normal())
  scores[:5] = np.round(scores[:5])  # many ties in these rows
  scores[5, : vocab - k // 2] = -np.inf  # fewer than k finite scores
  scores = jnp.asarray(scores)
  want_values, want_ids = jax.lax.top_k(scores, k)
  values, ids = top_k._largest(scores, k, blocked=True)
  np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def test_the_gpu_selects_in_blocks_past_k_16():
  from mst_jax._losses import top_k

  assert top_k._blocked("gpu", 64, 128256)
  assert not top_k._blocked("gpu", 16, 128256)  # lax.top_k's own fast path
  assert not top_k._blocked("gpu", 64, 500)  # one block
  assert not top_k._blocked("cpu", 64, 128256)


@pytest.mark.gpu
def test_top_k_64_on_the_gpu(rng):
  """At k = 64 a GPU selects in blocks; the ids are still a top k of the
  float64 scores and the log-probs the float64 ones (bfloat16 inputs, float32
  logits: exact products, unlike a float32 matmul in TF32)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  n, dim, vocab, k = 301, 64, 5003, 64
  hidden = jnp.asarray(rng.standard_normal((n, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((vocab, dim)) / np.sqrt(dim), jnp.bfloat16)
  log_probs, ids = mst_jax.linear_top_k(
    hidden, weight, k, chunk_size=128, logits_dtype=jnp.float32
  )
  scores = _scores64(hidden, weight, None, "vd", None, None)
  _check_selection(scores, log_probs, ids, GPU_LOSS_RTOL["bfloat16"])
