"""``linear_log_probs`` at several ids per position (``labels [..., K]``)
against the float64 oracle: each id's column is the oracle's log-probs with
that id as the label (tests/oracle.py, full float64 logits), and the entropy
the oracle's at the positions holding a counted id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import to64

import mst_jax

# The quick run takes every value of every parameter here (conftest._mark_slow).
EVERY_VALUE_QUICKLY = True

IGNORE = -100
# float32 math on float32 logits (bfloat16 inputs here get float32 logits);
# relative to the float64 oracle's norm. A dropped term errs by about 1.
OUT_TOL = {"float32": 2e-5, "bfloat16": 2e-5, "float16": 2e-5}
GRAD_TOL = {"float32": 2e-4, "bfloat16": 2e-2, "float16": 5e-3}


def ids_problem(rng, batch, dim, vocab, k, dtype, weight_layout, bias, ignore=IGNORE):
  hidden = rng.standard_normal((*batch, dim))
  weight = rng.standard_normal((vocab, dim)) * 1.5 / np.sqrt(dim)
  if weight_layout == "dv":
    weight = weight.T
  ids = rng.integers(0, vocab, (*batch, k))
  ids[rng.random(ids.shape) < 0.25] = ignore  # ignored ids here and there
  ids.reshape(-1, k)[1] = ignore  # a position with none counted
  where = rng.random(batch) > 0.2
  arrays = dict(
    hidden=jnp.asarray(hidden, dtype),
    weight=jnp.asarray(weight, dtype),
    bias=jnp.asarray(rng.standard_normal(vocab) * 0.3, dtype) if bias else None,
  )
  return arrays, jnp.asarray(ids), jnp.asarray(where)


def _shifted(x, fill):
  """Position t sees position t + 1's value (along the positions' axis)."""
  x = np.asarray(x)
  last = np.full_like(x[..., :1, ...] if x.ndim == 1 else x[:, :1], fill)
  return np.concatenate([x[:, 1:], last], axis=1)


def ids_oracle(arrays, ids, where, cotangents, *, shift, ignore=IGNORE, **head):
  """float64 ``(log_probs [..., K], entropy, grads)``: column k from the
  oracle with ``ids[..., k]`` as the labels; the gradient of
  ``sum(g_lp * log_probs) + sum(g_h * entropy)``."""
  g_lp, g_h = cotangents
  ids, where = np.asarray(ids), np.asarray(where)
  shifted_ids = _shifted(ids, ignore) if shift else ids
  shifted_where = _shifted(where, False) if shift else where
  counted = np.any(shifted_ids != ignore, axis=-1) & shifted_where
  # Entropy at the positions with a counted id: any other in-range label will do.
  entropy_labels = np.where(counted, int(ignore == 0), ignore)
  if shift:  # the oracle shifts labels and where itself: undo it for these
    entropy_labels = np.concatenate(
      [np.full_like(entropy_labels[:, :1], ignore), entropy_labels[:, :-1]], axis=1
    )
  names = [n for n in ("hidden", "weight", "bias") if arrays[n] is not None]

  def outputs(*args):
    kw = dict(zip(names, args, strict=True))
    call = lambda labels, **extra: oracle64.log_probs(
      kw["hidden"], kw["weight"], jnp.asarray(labels), kw.get("bias"),
      ignore_index=ignore, where=jnp.asarray(where), shift=shift, **head, **extra,
    )  # fmt: skip
    columns = [call(ids[..., k]) for k in range(ids.shape[-1])]
    _, entropy = call(entropy_labels, return_entropy=True)
    return jnp.stack(columns, axis=-1), entropy

  with jax.enable_x64(True):
    args = [jnp.asarray(to64(arrays[n])) for n in names]
    lp, h = outputs(*args)

    def total(*a):
      lp, h = outputs(*a)
      return jnp.sum(lp * g_lp) + jnp.sum(h * g_h)

    grads = jax.grad(total, argnums=tuple(range(len(args))))(*args)
    return np.asarray(lp), np.asarray(h), [to64(g) for g in grads]


def _rel(out, ref):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


CASES = [
  # dtype, K, shift, weight_layout, bias, extra options
  ("float32", 6, False, "vd", True, {}),
  ("float32", 2, True, "dv", False, {"logit_softcap": 4.0}),
  # an ignore_index inside the vocabulary, first at some positions
  ("float32", 3, True, "vd", True, {"ignore_index": 0}),
  ("float32", 5, True, "vd", True, {"chunk_size": 8, "logit_scale": 0.7}),
  ("float32", 7, False, "dv", True, {"grad_mode": "recompute", "impl": "pallas"}),
  ("bfloat16", 6, True, "vd", True, {"logits_dtype": jnp.float32}),
  ("float32", 4, False, "vd", True, {"vocab_block_size": 64}),
  # float16: gradients of unit cotangents, the ids' among them, scaled back
  ("float16", 4, False, "vd", True, {"logits_dtype": jnp.float32}),
  ("float32", 3, True, "dv", False, {"grad_mode": "recompute", "chunk_size": 8}),
  ("float32", 3, False, "vd", True, {"impl": "reference"}),  # the full logits
]


@pytest.mark.parametrize("dtype,k,shift,weight_layout,bias,options", CASES)
def test_log_probs_at_ids_match_the_oracle(
  rng, dtype, k, shift, weight_layout, bias, options
):
  ignore = options.get("ignore_index", IGNORE)
  arrays, ids, where = ids_problem(
    rng, (3, 11), 24, 301, k, dtype, weight_layout, bias, ignore
  )
  lp_shape, h_shape = ids.shape, ids.shape[:-1]
  cotangents = (rng.standard_normal(lp_shape), rng.standard_normal(h_shape))
  head = {n: options[n] for n in ("logit_scale", "logit_softcap") if n in options}
  ref_lp, ref_h, ref_grads = ids_oracle(
    arrays, ids, where, cotangents, shift=shift, weight_layout=weight_layout,
    ignore=ignore, **head,
  )  # fmt: skip
  names = [n for n in ("hidden", "weight", "bias") if arrays[n] is not None]

  def outputs(*args):
    kw = dict(zip(names, args, strict=True))
    return mst_jax.linear_log_probs(
      kw["hidden"], kw["weight"], ids, kw.get("bias"), where=where, shift=shift,
      weight_layout=weight_layout, return_entropy=True, **options,
    )  # fmt: skip

  def total(*args):
    lp, h = outputs(*args)
    g_lp, g_h = (jnp.asarray(c, lp.dtype) for c in cotangents)
    return jnp.sum(lp * g_lp) + jnp.sum(h * g_h)

  args = [arrays[n] for n in names]
  lp, h = jax.jit(outputs)(*args)
  assert lp.shape == ids.shape and h.shape == ids.shape[:-1]
  assert not np.isnan(np.asarray(lp)).any()
  assert _rel(lp, ref_lp) < OUT_TOL[dtype], _rel(lp, ref_lp)
  assert _rel(h, ref_h) < OUT_TOL[dtype], _rel(h, ref_h)
  ignored = np.asarray(ids) == ignore
  if shift:
    ignored = _shifted(ignored, True)
  assert np.all(np.asarray(lp)[ignored] == 0.0)
  grads = jax.jit(jax.grad(total, argnums=tuple(range(len(args)))))(*args)
  for name, g, ref in zip(names, grads, ref_grads, strict=True):
    assert _rel(g, ref) < GRAD_TOL[dtype], (name, _rel(g, ref))


@pytest.mark.parametrize("options", [{}, {"grad_mode": "recompute", "chunk_size": 5}])
def test_a_repeated_id_adds_its_cotangents(rng, options):
  """An id given twice at a position gets both cotangents (the backward adds
  them at the same column of ``dlogits``): the same values and gradients as
  the id once with their sum."""
  arrays, ids, where = ids_problem(rng, (2, 7), 12, 53, 2, "float32", "vd", True)
  ids = jnp.where(ids < 0, 3, ids)  # every id counted
  twice = jnp.concatenate([ids[..., :1], ids], axis=-1)  # [a, a, b]
  g = jnp.asarray(rng.standard_normal(twice.shape), jnp.float32)
  once_g = jnp.stack([g[..., 0] + g[..., 1], g[..., 2]], axis=-1)
  args = (arrays["hidden"], arrays["weight"], arrays["bias"])

  def total(labels, cot, *a):
    lp = mst_jax.linear_log_probs(*a[:2], labels, a[2], where=where, **options)
    return jnp.sum(lp * cot), lp

  step = jax.value_and_grad(total, argnums=(2, 3, 4), has_aux=True)
  (t2, lp2), g2 = step(twice, g, *args)
  (t1, lp1), g1 = step(ids, once_g, *args)
  np.testing.assert_allclose(np.asarray(lp2[..., 1:]), np.asarray(lp1), rtol=1e-6)
  np.testing.assert_allclose(
    np.asarray(lp2[..., 0]), np.asarray(lp1[..., 0]), rtol=1e-6
  )
  scale = float(jnp.sum(jnp.abs(lp2 * g)))  # the sum may cancel to near 0
  assert abs(float(t2) - float(t1)) <= 1e-6 * scale
  for a, b in zip(g2, g1, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_the_logits_are_formed_once_whatever_k(rng):
  """The program's matmuls do not grow with K: the ids' logits come from the
  chunks' logits, not from products with their weight rows."""
  arrays, ids, where = ids_problem(rng, (2, 9), 16, 97, 8, "float32", "vd", False)
  args = (arrays["hidden"], arrays["weight"])

  def dots(labels):
    total = lambda h, w: jnp.sum(mst_jax.linear_log_probs(h, w, labels, where=where))
    text = jax.jit(jax.grad(total, argnums=(0, 1))).lower(*args).as_text()
    return text.count("dot_general")

  assert dots(ids[..., :2]) == dots(ids) == dots(jnp.maximum(ids[..., 0], 0))


def test_one_id_a_position_is_a_label(rng):
  """``labels [..., 1]`` takes the one-label program: the same log-probs,
  entropy and gradients, bit for bit, with a trailing axis."""
  arrays, ids, where = ids_problem(rng, (2, 9), 16, 97, 1, "float32", "vd", True)
  args = (arrays["hidden"], arrays["weight"], arrays["bias"])
  g = jnp.asarray(rng.standard_normal(ids.shape[:-1]), jnp.float32)

  def step(labels):
    def total(h, w, b):
      lp, ent = mst_jax.linear_log_probs(
        h, w, labels, b, where=where, shift=True, return_entropy=True
      )
      return jnp.sum(lp.reshape(g.shape) * g) + jnp.sum(ent), (lp, ent)

    return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))(*args)

  (t1, (lp1, ent1)), g1 = step(ids)
  (t0, (lp0, ent0)), g0 = step(ids[..., 0])
  assert lp1.shape == ids.shape and ent1.shape == ids.shape[:-1]
  for a, b in [(t1, t0), (lp1[..., 0], lp0), (ent1, ent0), *zip(g1, g0, strict=True)]:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# bfloat16 logits (the Hopper program's): each rounded to 2**-9 relative.
BF16_LOGITS_TOL = {"out": 1e-2, "grad": 5e-2}


@pytest.mark.parametrize(
  "options",
  [{}, {"grad_mode": "recompute", "chunk_size": 64}, {"vocab_block_size": 384}],
  ids=str,
)
def test_ids_on_the_mosaic_kernels(rng, mosaic_on_cpu, options):
  """The Hopper program on a CPU (the GEMM as an XLA product, the kernels in
  interpret mode): the ids' logits come from padded logits of a ragged
  vocabulary, their cotangents go into the kernels' dlogits."""
  arrays, ids, where = ids_problem(rng, (2, 70), 128, 1001, 5, "bfloat16", "vd", True)
  cotangents = (rng.standard_normal(ids.shape), rng.standard_normal(ids.shape[:-1]))
  ref_lp, ref_h, ref_grads = ids_oracle(arrays, ids, where, cotangents, shift=False)
  args = (arrays["hidden"], arrays["weight"], arrays["bias"])

  def total(*a):
    lp, h = mst_jax.linear_log_probs(
      a[0], a[1], ids, a[2], where=where, return_entropy=True, impl="mosaic", **options
    )
    g_lp, g_h = (jnp.asarray(c, lp.dtype) for c in cotangents)
    return jnp.sum(lp * g_lp) + jnp.sum(h * g_h), (lp, h)

  (_, (lp, h)), grads = jax.jit(jax.value_and_grad(total, (0, 1, 2), has_aux=True))(
    *args
  )
  assert _rel(lp, ref_lp) < BF16_LOGITS_TOL["out"], _rel(lp, ref_lp)
  assert _rel(h, ref_h) < BF16_LOGITS_TOL["out"], _rel(h, ref_h)
  for g, ref in zip(grads, ref_grads, strict=True):
    assert _rel(g, ref) < BF16_LOGITS_TOL["grad"], _rel(g, ref)
  padded = 256 if "vocab_block_size" in options else 1024  # 1001 = 2 * 384 + 233
  assert padded in mosaic_on_cpu  # the logits GEMM wrote padded logits


def test_an_id_out_of_range_is_nan_alone(rng):
  """An id outside the vocabulary gives NaN, the other ids their values; a
  position whose ids all lie outside keeps its entropy, as with one label."""
  arrays, ids, _ = ids_problem(rng, (2, 5), 8, 41, 3, "float32", "vd", False)
  ids = np.asarray(ids).copy()
  ids[0, 2] = [3, 41, IGNORE]  # in range, out of range, ignored
  ids[1, 4] = [41, 97, 41]  # none in range
  lp, h = mst_jax.linear_log_probs(
    arrays["hidden"], arrays["weight"], jnp.asarray(ids), return_entropy=True
  )
  lp = np.asarray(lp)
  assert np.isnan(lp[0, 2, 1]) and lp[0, 2, 2] == 0.0 and np.isfinite(lp[0, 2, 0])
  assert np.isnan(lp[1, 4]).all()
  counted = np.any(ids != IGNORE, axis=-1)
  with jax.enable_x64(True):
    _, ref_h = oracle64.log_probs(
      jnp.asarray(to64(arrays["hidden"])), jnp.asarray(to64(arrays["weight"])),
      jnp.asarray(np.where(counted, 0, IGNORE)), return_entropy=True,
    )  # fmt: skip
  assert _rel(h, np.asarray(ref_h)) < OUT_TOL["float32"], _rel(h, np.asarray(ref_h))
