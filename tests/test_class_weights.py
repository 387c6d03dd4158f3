"""``class_weights`` against the float64 oracle, tests/oracle.py.

torch's ``cross_entropy(weight=w, label_smoothing=eps)``: per valid token
``(1 - eps) * w[y] * (lse - s[y]) + (eps / V) * sum_c w[c] * (lse - s[c])``;
the mean divides by the sum of ``w[y]`` over valid tokens. Here also: a token
weight multiplies the token's loss (z-loss included) and the mean's
denominator term; the z-loss is not class-weighted. The oracle is that
formula in float64 on the full logits, differentiated by autodiff
(test_reference.py checks it against a token-by-token numpy loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import LOOP_ORDERS, check_grads_against_naive, make_problem, to64

import mst_jax


def _oracle(problem, w, token_weights, *, reduction, eps, z_loss, shift, layout):
  """float64 loss (summed per token for ``"none"``) and gradients."""
  argnums = (0, 1, 2) if problem.bias is not None else (0, 1)
  with jax.enable_x64(True):

    def loss(hidden, weight, bias=None):
      return oracle64.cross_entropy(
        hidden,
        weight,
        problem.labels,
        bias,
        where=problem.where,
        class_weights=np.asarray(w, np.float64),
        token_weights=token_weights,
        reduction=reduction,
        label_smoothing=eps,
        z_loss=z_loss,
        shift=shift,
        weight_layout=layout,
      )

    inputs = (problem.hidden, problem.weight, problem.bias)[: len(argnums)]
    args = [jnp.asarray(to64(x)) for x in inputs]
    value = loss(*args)
    grads = jax.grad(lambda *a: jnp.sum(loss(*a)), argnums=argnums)(*args)
    return np.asarray(value), [np.asarray(g) for g in grads]


def _rel(out, ref):
  out, ref = np.asarray(jnp.asarray(out, jnp.float32), np.float64), np.asarray(ref)
  return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def _class_weights(rng, vocab):
  """Random weights in ``[0, 2)``, some classes switched off."""
  w = rng.random(vocab) * 2.0
  w[rng.integers(0, vocab, vocab // 20)] = 0.0
  return w


@pytest.mark.parametrize(
  "eps, z_loss, token_weighted, shift, bias, layout, loop_order, reduction, grad_mode,"
  " impl",
  [
    (0.0, 0.0, False, False, False, "vd", "row_chunks", "mean", "fused", "xla"),
    (0.0, 0.0, False, False, False, "vd", "vocab_blocks", "none", None, "xla"),
    (0.1, 1e-3, False, True, True, "dv", "vocab_blocks", "mean", "recompute", "xla"),
    (0.1, 1e-3, False, True, True, "dv", "row_chunks", "sum", None, "xla"),
    (0.2, 0.0, True, False, True, "vd", "vocab_blocks", "mean", "fused", "xla"),
    (0.2, 0.0, True, False, True, "vd", "row_chunks", "none", None, "xla"),
    (0.1, 1e-3, True, True, False, "dv", "row_chunks", "mean", "recompute", "xla"),
    (0.1, 1e-3, True, True, False, "dv", "vocab_blocks", "sum", "fused", "xla"),
    # Without smoothing the label's weight is per row: the kernels take it.
    (0.0, 1e-3, True, True, False, "vd", "row_chunks", "mean", "fused", "pallas"),
    (0.0, 0.0, False, False, True, "dv", "vocab_blocks", "none", None, "pallas"),
    (0.0, 1e-3, False, False, True, "vd", "row_chunks", "sum", "recompute", "pallas"),
  ],
)
def test_class_weights_match_torch_semantics(
  rng,
  loop_order,
  reduction,
  grad_mode,
  eps,
  z_loss,
  token_weighted,
  shift,
  bias,
  layout,
  impl,
):
  problem = make_problem(
    rng, (3, 23), dim=16, vocab=1031, bias=bias, weight_layout=layout, mask="scattered"
  )
  w = _class_weights(rng, 1031)
  token_weights = rng.random(problem.labels.shape) * 2 if token_weighted else None
  argnums = (0, 1, 3) if bias else (0, 1)

  def loss(hidden, weight, labels, b):
    out = mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      b,
      where=problem.where,
      class_weights=jnp.asarray(w, jnp.float32),
      token_weights=None if token_weights is None else jnp.asarray(token_weights),
      reduction=reduction,
      label_smoothing=eps,
      z_loss=z_loss,
      shift=shift,
      weight_layout=layout,
      impl=impl,
      chunk_size=16,
      grad_mode=grad_mode,
      **LOOP_ORDERS[loop_order],
    )
    return out

  value = jax.jit(loss)(*problem.args)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(loss(*a)), argnums=argnums))(
    *problem.args
  )
  ref, ref_grads = _oracle(
    problem,
    w,
    token_weights,
    reduction=reduction,
    eps=eps,
    z_loss=z_loss,
    shift=shift,
    layout=layout,
  )
  assert value.dtype == jnp.float32 and value.shape == np.shape(ref)
  assert _rel(value, ref) < 2e-5, _rel(value, ref)
  for g, r in zip(grads, ref_grads, strict=True):
    assert _rel(g, r) < 2e-4, _rel(g, r)


def test_uniform_class_weights_change_nothing(rng):
  problem = make_problem(rng, (41,), dtype="float32", bias=True)
  kwargs = dict(where=problem.where, label_smoothing=0.1, z_loss=1e-3, impl="xla")
  plain = mst_jax.linear_cross_entropy(*problem.args, **kwargs)
  ones = jnp.ones(problem.weight.shape[0])
  weighted = mst_jax.linear_cross_entropy(*problem.args, class_weights=ones, **kwargs)
  np.testing.assert_allclose(np.asarray(weighted), np.asarray(plain), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
  "kwargs",
  [dict(), dict(label_smoothing=0.3, vocab_block_size=256, impl="xla")],
  ids=["plain", "smoothed_blocks"],
)
def test_all_weights_zero_give_zero_loss(rng, reduction, kwargs):
  """No class of any weight: a loss of exactly 0 (the mean's denominator is
  0, and with smoothing so is the weighted mean's over the vocabulary
  blocks), with zero gradients."""
  problem = make_problem(rng, (9,), dim=32, vocab=1001, dtype="float32", mask="none")
  zeros = jnp.zeros(problem.weight.shape[0])

  def loss(hidden, weight):
    return jnp.sum(
      mst_jax.linear_cross_entropy(
        hidden,
        weight,
        problem.labels,
        class_weights=zeros,
        reduction=reduction,
        **kwargs,
      )
    )

  value, grads = jax.value_and_grad(loss, argnums=(0, 1))(
    problem.hidden, problem.weight
  )
  assert float(value) == 0.0
  for g in grads:
    assert not np.asarray(g).any()


def test_bad_class_weights_raise(rng):
  problem = make_problem(rng, (5,), dtype="float32")
  args = problem.args[:3]
  vocab = problem.weight.shape[0]
  with pytest.raises(TypeError, match="class_weights"):
    mst_jax.linear_cross_entropy(*args, class_weights=jnp.ones(vocab, jnp.int32))
  with pytest.raises(ValueError, match="class_weights"):
    mst_jax.linear_cross_entropy(*args, class_weights=jnp.ones(vocab + 1))
  with pytest.raises(NotImplementedError, match="class weights with label smoothing"):
    mst_jax.linear_cross_entropy(
      *args, class_weights=jnp.ones(vocab), label_smoothing=0.1, impl="pallas"
    )


@pytest.mark.gpu
def test_class_weights_on_the_gpu(rng):
  """The default backend with class weights (XLA), unaligned sizes, float32
  inputs at the GPU's matmul precision."""
  problem = make_problem(rng, (4, 301), dim=72, vocab=5003, dtype="float32", bias=True)
  w = rng.random(5003) * 2.0
  kwargs = dict(where=problem.where, label_smoothing=0.1, z_loss=1e-3)

  def loss(hidden, weight, labels, bias):
    return mst_jax.linear_cross_entropy(
      hidden, weight, labels, bias, class_weights=jnp.asarray(w, jnp.float32), **kwargs
    )

  value, grads = jax.value_and_grad(loss, argnums=(0, 1, 3))(*problem.args)
  ref, ref_grads = _oracle(
    problem, w, None, reduction="mean", eps=0.1, z_loss=1e-3, shift=False, layout="vd"
  )
  assert _rel(value, ref) < 3e-3
  for g, r in zip(grads, ref_grads, strict=True):
    assert _rel(g, r) < 3e-3


# bfloat16 logits round by up to 2^-9 of themselves (test_mosaic_bias's
# bounds); a class weight applied wrongly moves the loss by tens of percent.
BF16_LOSS_RTOL = 5e-3


def _bf16_step(problem, w, **kwargs):
  """The loss and its gradients wrt hidden, weight (and bias) with class
  weights against the float64 oracle: the loss at bfloat16's bounds, the
  gradients within a multiple of the naive bfloat16 head's error."""
  argnums = (0, 1) if problem.bias is None else (0, 1, 3)

  def loss(hidden, weight, labels, bias):
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      bias,
      where=problem.where,
      class_weights=jnp.asarray(w),
      **kwargs,
    )

  total = lambda *args: jnp.sum(loss(*args))  # per token: their sum
  value, grads = jax.jit(jax.value_and_grad(total, argnums=argnums))(*problem.args)
  keys = ("reduction", "z_loss", "shift")
  options = {k: kwargs[k] for k in keys if k in kwargs}
  options = dict(reduction="mean", z_loss=0.0, shift=False) | options
  layout = kwargs.get("weight_layout", "vd")
  eps = kwargs.get("label_smoothing", 0.0)
  ref, ref_grads = _oracle(problem, w, None, eps=eps, layout=layout, **options)
  ref = np.sum(ref)
  assert _rel(value, ref) < BF16_LOSS_RTOL, _rel(value, ref)
  check_grads_against_naive(problem, grads, ref_grads, class_weights=w, **kwargs)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(chunk_size=64, grad_mode="recompute", z_loss=1e-3),
    dict(chunk_size=64, vocab_block_size=384, reduction="sum"),
    dict(reduction="none", shift=True),  # kept logits
    dict(memory_budget=1 << 19),  # whole groups' buffers
  ],
  ids=str,
)
def test_class_weights_without_smoothing_on_the_mosaic_kernels(
  rng, mosaic_on_cpu, kwargs
):
  """The Hopper program on a CPU (the GEMM as an XLA product, the kernels in
  interpret mode): the label's class weight rides in ``coef_target``, which
  the Mosaic kernels read; a ragged vocabulary of padded logits."""
  problem = make_problem(
    rng, (2, 150), dim=128, vocab=1001, dtype="bfloat16", bias=True
  )
  _bf16_step(problem, _class_weights(rng, 1001), impl="mosaic", **kwargs)
  padded = 256 if "vocab_block_size" in kwargs else 1024
  assert padded in mosaic_on_cpu  # the logits GEMM wrote padded logits


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(label_smoothing=0.3),
    dict(label_smoothing=0.4, chunk_size=64, grad_mode="recompute", z_loss=1e-3),
    dict(label_smoothing=0.3, chunk_size=64, vocab_block_size=384, reduction="sum"),
    dict(label_smoothing=0.3, reduction="none", shift=True),  # kept logits
    dict(label_smoothing=0.3, memory_budget=1 << 19),  # whole groups' buffers
    dict(label_smoothing=0.3, weight_layout="dv", z_loss=1e-3),
  ],
  ids=str,
)
def test_class_weights_with_smoothing_on_the_mosaic_kernels(rng, mosaic_on_cpu, kwargs):
  """The Hopper program on a CPU, as above, with label smoothing: the class
  weights reach both kernels (which walk their columns beside the logits'
  tiles) in every loop order and mode, over padded logits of 296 rows (whole
  TMA tiles, so the kernels take them). ``test_mosaic_ce`` checks the
  kernels' arithmetic at tighter bounds."""
  layout = kwargs.get("weight_layout", "vd")
  problem = make_problem(
    rng,
    (2, 148),
    dim=128,
    vocab=1001,
    dtype="bfloat16",
    bias=True,
    weight_layout=layout,
  )
  _bf16_step(problem, _class_weights(rng, 1001), impl="mosaic", **kwargs)
  padded = 256 if "vocab_block_size" in kwargs else 1024
  assert padded in mosaic_on_cpu  # the logits GEMM wrote padded logits


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_class_weights_lower_to_mosaic_kernels(as_if_on_hopper, eps):
  """Lowered for CUDA: the default step with class weights runs Mosaic
  kernels alone. Without smoothing they are the ones without class weights
  (the statistics in the logits GEMM's epilogue, ``dlogits`` on the CE
  kernel); with smoothing the CE kernels walk the class weights too, and
  the statistics come from the statistics kernel, whose sum of scores the
  weights weigh."""
  n, d, vocab = 1000, 256, 32000
  h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((vocab, d), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)
  c = jax.ShapeDtypeStruct((vocab,), jnp.float32)

  def kernels(class_weights):
    def loss(h, w, y, c):
      return mst_jax.linear_cross_entropy(h, w, y, class_weights=c, label_smoothing=eps)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = step.trace(h, w, y, class_weights).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    assert "triton" not in text and "stablehlo.dot_general" not in text
    return text.count("custom_call @mosaic_gpu"), "_rows_mosaic" in text

  plain, weighted = kernels(None), kernels(c)
  assert plain[1]  # the statistics in the GEMM's epilogue
  assert (weighted == plain) == (eps == 0.0)
  assert weighted[1] == (eps == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_class_weights_on_the_mosaic_kernels_on_the_gpu(rng, layout, eps):
  """The default backend (the Mosaic kernels on Hopper) at GPT-2's ragged
  vocabulary and an unaligned row count, bfloat16, with and without label
  smoothing (then both kernels read the class weights' columns)."""
  problem = make_problem(
    rng, (3, 333), dim=256, vocab=50257, dtype="bfloat16", weight_layout=layout
  )
  w = _class_weights(rng, 50257)
  _bf16_step(problem, w, weight_layout=layout, z_loss=1e-4, label_smoothing=eps)


@pytest.mark.gpu
def test_class_weights_with_smoothing_at_llama_3s_vocabulary(rng):
  """Whole 64-column tiles (no padding), several row chunks and groups."""
  problem = make_problem(rng, (4, 1000), dim=512, vocab=128256, dtype="bfloat16")
  w = _class_weights(rng, 128256)
  _bf16_step(problem, w, label_smoothing=0.3, chunk_size=1024, reduction="sum")


@pytest.mark.parametrize("loop_order", list(LOOP_ORDERS))
def test_banned_classes_of_weight_zero(rng, loop_order):
  """A bias of -inf with class weight 0 (banned, padded classes) under label
  smoothing: finite, and the same on the chunked path and the reference as
  in the float64 oracle."""
  problem = make_problem(rng, (2, 13), dim=8, vocab=1031, bias=True, mask="none")
  bias = problem.bias.at[:300].set(-jnp.inf)
  labels = jnp.maximum(problem.labels, 300)
  weights = jnp.asarray(rng.random(1031), jnp.float32).at[:300].set(0.0)

  def run(**kwargs):
    loss = lambda h, w: mst_jax.linear_cross_entropy(
      h, w, labels, bias, class_weights=weights, label_smoothing=0.1, **kwargs
    )
    return jax.value_and_grad(loss, argnums=(0, 1))(problem.hidden, problem.weight)

  out = run(impl="xla", chunk_size=8, **LOOP_ORDERS[loop_order])
  ref = run(impl="reference")
  with jax.enable_x64(True):
    loss64 = lambda h, w: oracle64.cross_entropy(
      h, w, labels, to64(bias), class_weights=to64(weights), label_smoothing=0.1
    )
    want = jax.value_and_grad(loss64, argnums=(0, 1))(
      *(jnp.asarray(to64(x)) for x in (problem.hidden, problem.weight))
    )
  for got in (out, ref):
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    for a, b in pairs:
      assert np.isfinite(np.asarray(a)).all()
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
