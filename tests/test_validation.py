"""Bad input raises at trace time with a message that names the problem."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import mst_jax

N, D, V = 6, 4, 11


def _args(**overrides):
  args = dict(
    hidden=jnp.ones((N, D)),
    weight=jnp.ones((V, D)),
    labels=jnp.zeros((N,), jnp.int32),
    bias=None,
  )
  args.update(overrides)
  return args


def _call(overrides=(), **kwargs):
  return mst_jax.linear_cross_entropy(**_args(**dict(overrides)), **kwargs)


@pytest.mark.parametrize(
  "overrides, kwargs, error, match",
  [
    (dict(weight=jnp.ones((V, D + 1))), {}, ValueError, r"\(6, 4\).*\(11, 5\)"),
    (
      dict(weight=jnp.ones((V, D))),
      dict(weight_layout="dv"),
      ValueError,
      "weight_layout='dv'",
    ),
    (dict(weight=jnp.ones((V, D, 1))), {}, ValueError, "2-D"),
    # A [D, V] weight with the default layout, and logits passed as hidden.
    (dict(weight=jnp.ones((D, V))), {}, ValueError, "pass weight_layout='dv'"),
    (dict(hidden=jnp.ones((N, V))), {}, ValueError, "hidden holds logits"),
    (dict(labels=None), {}, TypeError, "labels is None"),
    (dict(hidden=jnp.ones((D,))), {}, ValueError, r"\[N, D\]"),
    (
      dict(labels=jnp.zeros((N + 1,), jnp.int32)),
      {},
      ValueError,
      r"labels shape \(7,\).*\(6,\)",
    ),
    (dict(labels=jnp.zeros((N,), jnp.float32)), {}, TypeError, "integer"),
    (dict(hidden=jnp.ones((N, D), jnp.int32)), {}, TypeError, "hidden.*int32"),
    (dict(weight=jnp.ones((V, D), jnp.int32)), {}, TypeError, "weight.*int32"),
    (dict(bias=jnp.ones((V + 1,))), {}, ValueError, r"bias.*\(11,\).*\(12,\)"),
    (dict(bias=jnp.ones((V,), jnp.int32)), {}, TypeError, "bias"),
    ({}, dict(where=jnp.ones((N,), jnp.int32)), TypeError, "where.*int32"),
    ({}, dict(where=jnp.ones((N, 1), bool)), ValueError, r"where shape \(6, 1\)"),
    (
      {},
      dict(token_weights=jnp.ones((N,), jnp.int32)),
      TypeError,
      "token_weights.*int32",
    ),
    (
      {},
      dict(token_weights=jnp.ones((N, 1))),
      ValueError,
      r"token_weights shape \(6, 1\)",
    ),
    ({}, dict(reduction="avg"), ValueError, "reduction.*'avg'"),
    ({}, dict(weight_layout="VD"), ValueError, "weight_layout.*'VD'"),
    ({}, dict(impl="cuda"), ValueError, "impl.*'cuda'"),
    ({}, dict(label_smoothing=-0.1), ValueError, "label_smoothing.*-0.1"),
    ({}, dict(label_smoothing=1.5), ValueError, "label_smoothing.*1.5"),
    ({}, dict(label_smoothing=float("nan")), ValueError, "label_smoothing.*nan"),
    ({}, dict(z_loss=-1.0), ValueError, "z_loss.*-1.0"),
    ({}, dict(z_loss=float("inf")), ValueError, "z_loss.*inf"),
    ({}, dict(logit_softcap=0.0), ValueError, "logit_softcap.*0.0"),
    ({}, dict(logit_softcap=-3.0), ValueError, "logit_softcap.*-3.0"),
    ({}, dict(logit_softcap="30"), TypeError, "logit_softcap"),
    ({}, dict(logit_scale=0.0), ValueError, "logit_scale.*0.0"),
    ({}, dict(logit_scale=-2.0), ValueError, "logit_scale.*-2.0"),
    ({}, dict(logit_scale=float("inf")), ValueError, "logit_scale.*inf"),
    ({}, dict(logit_scale="2"), TypeError, "logit_scale"),
    ({}, dict(chunk_size=0), ValueError, "chunk_size.*0"),
    ({}, dict(chunk_size=2.5), TypeError, "chunk_size.*2.5"),
    ({}, dict(vocab_block_size=0), ValueError, "vocab_block_size.*0"),
    ({}, dict(vocab_block_size=1.5), TypeError, "vocab_block_size.*1.5"),
    ({}, dict(ignore_index=1.5), TypeError, "ignore_index"),
    ({}, dict(shift=1), TypeError, "shift"),
    ({}, dict(return_aux="yes"), TypeError, "return_aux"),
    ({}, dict(accum_dtype=jnp.int32), TypeError, "accum_dtype.*int32"),
    ({}, dict(logits_dtype="int8"), TypeError, "logits_dtype.*int8"),
    ({}, dict(logits_dtype="float64"), ValueError, "logits_dtype=float64 is wider"),
    ({}, dict(impl="reference", logits_dtype=jnp.float32), ValueError, "logits_dtype"),
    ({}, dict(impl="reference", chunk_size=4), ValueError, "impl='reference'"),
    ({}, dict(memory_budget=0), ValueError, "memory_budget.*0"),
    (
      {},
      dict(memory_budget="1GB"),
      TypeError,
      "memory_budget must be a number of bytes",
    ),
    ({}, dict(memory_budget=2.5), TypeError, "memory_budget must be a number of bytes"),
    ({}, dict(chunk_size=4, memory_budget=2**20), ValueError, "not both"),
    ({}, dict(grad_mode="forward"), ValueError, "grad_mode.*'forward'"),
    (
      {},
      dict(grad_mode="fused", reduction="none"),
      NotImplementedError,
      "grad_mode='recompute'",
    ),
  ],
)
def test_bad_input_raises(overrides, kwargs, error, match):
  with pytest.raises(error, match=match):
    _call(overrides, **kwargs)


def test_error_is_raised_at_trace_time():
  """Shapes are checked while tracing: no device work, not even under jit."""
  import jax

  with pytest.raises(ValueError, match="labels shape"):
    jax.jit(
      lambda h: mst_jax.linear_cross_entropy(
        h, jnp.ones((V, D)), jnp.zeros((N + 1,), jnp.int32)
      )
    ).lower(jax.ShapeDtypeStruct((N, D), jnp.float32))


def test_empty_batch_gives_zero_loss_and_gradients():
  hidden = jnp.ones((0, D))
  labels = jnp.zeros((0,), jnp.int32)
  weight = jnp.ones((V, D))
  import jax

  loss, grads = jax.value_and_grad(
    lambda h, w: mst_jax.linear_cross_entropy(h, w, labels), argnums=(0, 1)
  )(hidden, weight)
  assert float(loss) == 0.0 and loss.dtype == jnp.float32
  assert grads[0].shape == (0, D)
  np.testing.assert_array_equal(grads[1], 0.0)


_PUBLIC = {
  "linear_cross_entropy": lambda **kw: mst_jax.linear_cross_entropy(**_args(), **kw),
  "linear_log_probs": lambda **kw: mst_jax.linear_log_probs(**_args(), **kw),
  "linear_distillation_loss": lambda **kw: mst_jax.linear_distillation_loss(
    jnp.ones((N, D)), jnp.ones((V, D)), jnp.ones((N, D)), jnp.ones((V, D)), **kw
  ),
}


@pytest.mark.parametrize("name", sorted(_PUBLIC))
@pytest.mark.parametrize("typo", ["reducton", "weight_layot", "reduction_"])
def test_a_misspelt_keyword_is_named(name, typo):
  """Whatever its value (a string too, which jit alone reads as an array)."""
  for value in ("sum", 0.5):
    with pytest.raises(TypeError, match=rf"{name}\(\) .*keyword .*'{typo}'"):
      _PUBLIC[name](**{typo: value})


def test_log_probs_take_no_reduction():
  with pytest.raises(TypeError, match="unexpected keyword argument 'reduction'"):
    _PUBLIC["linear_log_probs"](reduction="sum")


def test_an_array_scalar_option_is_its_python_value(rng):
  import jax

  args = _args(
    hidden=jnp.asarray(rng.standard_normal((N, D)), jnp.float32),
    weight=jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
    labels=jnp.asarray(rng.integers(0, V, N), jnp.int32),
  )
  loss = mst_jax.linear_cross_entropy
  want = loss(**args, label_smoothing=0.25, ignore_index=2, shift=True)
  got = loss(
    **args, label_smoothing=jnp.float32(0.25), ignore_index=jnp.int32(2), shift=np.True_
  )
  np.testing.assert_array_equal(got, want)
  with pytest.raises(TypeError, match="label_smoothing is a static option"):
    jax.jit(lambda s: loss(**args, label_smoothing=s))(0.3)
  with pytest.raises(TypeError, match="z_loss is a static option"):
    loss(**args, z_loss=jnp.ones(2))


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_jit_of_grad_lowers_the_gradient(name, rng):
  """``jax.jit(jax.grad(f)).lower(...)`` compiles the gradient, not ``f``'s
  forward alone (``jax.grad``'s wrapper copies ``f``'s attributes)."""
  import jax

  arrays = [rng.standard_normal(s) for s in ((N, D), (V, D), (N, D))]
  labels = jnp.asarray(rng.integers(0, V, N), jnp.int32)

  def grad(module, hidden, weight, teacher):
    f = getattr(module, name)  # transformed directly, not through a lambda
    if "distill" in name:
      return jax.grad(f), (hidden, weight, teacher, weight, labels)
    return (jax.jacrev if "log_probs" in name else jax.grad)(f), (
      hidden,
      weight,
      labels,
    )

  fn, args = grad(mst_jax, *(jnp.asarray(x, jnp.float32) for x in arrays))
  got = jax.jit(fn).lower(*args).compile()(*args)
  with jax.enable_x64(True):
    fn, args = grad(mst_jax.reference, *(jnp.asarray(x) for x in arrays))
    want = fn(*args)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_a_whole_float_memory_budget_is_its_bytes():
  assert mst_jax.PerfOptions(memory_budget=1e9).memory_budget == 10**9
  assert mst_jax.PerfOptions(memory_budget=2.25 * 2**30).memory_budget == 9 << 28
  for scalar in (np.array(2**20), jnp.int32(2**20), np.float32(2**20)):
    assert mst_jax.PerfOptions(memory_budget=scalar).memory_budget == 2**20


def _exportable(name, module, **options):
  """A float scalar of ``(hidden, weight, teacher, labels)`` from ``name``:
  the loss, the log-probs' sum or the distillation loss, each of ``[n, D]``
  hidden states and a ``[V, D]`` weight."""
  f = getattr(module, name)

  def fn(hidden, weight, teacher, labels):
    if "distill" in name:
      return f(hidden, weight, teacher, weight, labels, **options)
    out = f(hidden, weight, labels, **options)
    return out if out.ndim == 0 else out.sum()

  return fn


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_an_exported_gradient_matches_the_oracle(name, rng):
  """``jax.export`` of the value and gradients, with concrete shapes and
  several chunks, runs the chunked program and matches the float64 oracle."""
  import jax
  from jax import export

  n_rows, dim, vocab = 37, 16, 1031
  arrays = [rng.standard_normal(s) for s in ((n_rows, dim), (vocab, dim))]
  arrays.append(rng.standard_normal((n_rows, dim)))
  labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
  args = (*(jnp.asarray(x, jnp.float32) for x in arrays), labels)
  fn = jax.value_and_grad(_exportable(name, mst_jax, chunk_size=8), (0, 1))
  exported = export.export(jax.jit(fn))(*args)
  got = exported.call(*args)
  with jax.enable_x64(True):
    ref = _exportable(name, mst_jax.reference)
    want = jax.value_and_grad(ref, (0, 1))(*(jnp.asarray(x) for x in arrays), labels)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_symbolic_shapes_raise_unless_reference(name, rng):
  """Exported with a symbolic number of tokens, the chunked loss raises a
  clear error (its chunks are planned from concrete sizes); the reference
  exports, and its program takes any number of tokens."""
  import jax
  from jax import export

  dim, vocab = 16, 1031
  (rows,) = export.symbolic_shape("n")
  spec = jax.ShapeDtypeStruct((rows, dim), jnp.float32)
  shapes = (spec, jax.ShapeDtypeStruct((vocab, dim), jnp.float32), spec)
  shapes += (jax.ShapeDtypeStruct((rows,), jnp.int32),)
  with pytest.raises(NotImplementedError, match=r"symbolic.*impl='reference'"):
    export.export(jax.jit(_exportable(name, mst_jax)))(*shapes)
  fn = _exportable(name, mst_jax, impl="reference")
  exported = export.export(jax.jit(fn))(*shapes)
  weight = rng.standard_normal((vocab, dim))
  for n_rows in (5, 37):
    hidden, teacher = rng.standard_normal((2, n_rows, dim))
    labels = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
    got = exported.call(
      *(jnp.asarray(x, jnp.float32) for x in (hidden, weight, teacher)), labels
    )
    with jax.enable_x64(True):
      ref = _exportable(name, mst_jax.reference)
      want = ref(*(jnp.asarray(x) for x in (hidden, weight, teacher)), labels)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
