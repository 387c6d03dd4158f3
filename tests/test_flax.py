"""The Flax modules: NNX and Linen ``LMHeadLoss`` against the float64 oracle."""

from __future__ import annotations

import doctest
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracle as oracle64
import pytest
from conftest import (
  GRAD_RTOL,
  LOSS_RTOL,
  NAIVE_FACTOR,
  NAIVE_FLOOR,
  Problem,
  _logits_rounding,
  assert_close,
  naive_head,
  to64,
)
from flax import nnx

import mst_jax

D, V = 24, 1031
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)


def _data(rng, shape=(3, 13), vocab=V):
  hidden = jnp.asarray(rng.standard_normal((*shape, D)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, vocab, shape), jnp.int32)
  where = jnp.asarray(rng.random(shape) > 0.3)
  return hidden, labels, where


def _oracle(hidden, weight, labels, bias, where, weight_layout, argnums, **options):
  """float64 loss and gradients from tests/oracle.py."""
  with jax.enable_x64(True):

    def loss(hidden, weight, bias):
      return oracle64.cross_entropy(
        hidden,
        weight,
        labels,
        bias,
        where=where,
        weight_layout=weight_layout,
        **options,
      )

    args = [None if x is None else jnp.asarray(to64(x)) for x in (hidden, weight, bias)]
    value, grads = jax.value_and_grad(loss, argnums=argnums)(*args)
    return np.asarray(value), [np.asarray(g) for g in grads]


@pytest.mark.parametrize(
  "order", [{}, dict(vocab_block_size=256, chunk_size=16)], ids=["rows", "low_memory"]
)
def test_nnx_module_matches_the_oracle(rng, order):
  head = mst_jax.nnx.LMHeadLoss(
    D, V, use_bias=True, rngs=nnx.Rngs(0), **OPTIONS, **order
  )
  head.bias[...] = jnp.asarray(rng.standard_normal(V) * 0.3, jnp.float32)
  hidden, labels, where = _data(rng)

  def loss(head, hidden):
    return head(hidden, labels, where=where)

  value, (grads, dhidden) = nnx.value_and_grad(loss, argnums=(0, 1))(head, hidden)
  ref, (ref_dh, ref_dk, ref_db) = _oracle(
    hidden, head.kernel[...], labels, head.bias[...], where, "dv", (0, 1, 2), **OPTIONS
  )
  assert_close(value, ref, LOSS_RTOL["float32"], "loss")
  assert_close(dhidden, ref_dh, GRAD_RTOL["float32"], "dhidden")
  assert_close(grads["kernel"][...], ref_dk, GRAD_RTOL["float32"], "dkernel")
  assert_close(grads["bias"][...], ref_db, GRAD_RTOL["float32"], "dbias")


@pytest.mark.parametrize("shift", [False, True])
def test_linen_and_nnx_agree_on_the_same_parameters(rng, shift):
  """shift=True: the modules take unshifted (Hugging Face style) labels too."""
  options = dict(OPTIONS, shift=shift)
  nnx_head = mst_jax.nnx.LMHeadLoss(D, V, use_bias=True, rngs=nnx.Rngs(1), **options)
  linen_head = mst_jax.linen.LMHeadLoss.create(V, use_bias=True, **options)
  hidden, labels, where = _data(rng)
  params = {"params": {"kernel": nnx_head.kernel[...], "bias": nnx_head.bias[...]}}
  initial = linen_head.init(jax.random.key(0), hidden, labels)
  assert jax.tree.map(jnp.shape, initial) == jax.tree.map(jnp.shape, params)

  linen_value, linen_grads = jax.value_and_grad(
    lambda p: linen_head.apply(p, hidden, labels, where=where)
  )(params)
  nnx_value, nnx_grads = nnx.value_and_grad(lambda m: m(hidden, labels, where=where))(
    nnx_head
  )
  ref, (ref_dk, ref_db) = _oracle(
    hidden,
    params["params"]["kernel"],
    labels,
    params["params"]["bias"],
    where,
    "dv",
    (1, 2),
    **options,
  )
  for value in (linen_value, nnx_value):
    assert_close(value, ref, LOSS_RTOL["float32"], "loss")
  for dk, db in (
    (linen_grads["params"]["kernel"], linen_grads["params"]["bias"]),
    (nnx_grads["kernel"][...], nnx_grads["bias"][...]),
  ):
    assert_close(dk, ref_dk, GRAD_RTOL["float32"], "dkernel")
    assert_close(db, ref_db, GRAD_RTOL["float32"], "dbias")


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_class_and_token_weights_reach_the_function(rng, api):
  """The modules pass class_weights and token_weights on unchanged."""
  hidden, labels, where = _data(rng)
  class_weights = jnp.asarray(rng.random(V) * 2, jnp.float32)
  token_weights = jnp.asarray(rng.random(labels.shape), jnp.float32)
  weights = dict(where=where, class_weights=class_weights, token_weights=token_weights)
  if api == "nnx":
    head = mst_jax.nnx.LMHeadLoss(D, V, rngs=nnx.Rngs(2), **OPTIONS)
    value, kernel = head(hidden, labels, **weights), head.kernel[...]
  else:
    head = mst_jax.linen.LMHeadLoss.create(V, **OPTIONS)
    params = head.init(jax.random.key(2), hidden, labels)
    value = head.apply(params, hidden, labels, **weights)
    kernel = params["params"]["kernel"]
  direct = mst_jax.linear_cross_entropy(
    hidden, kernel, labels, weight_layout="dv", **weights, **OPTIONS
  )
  np.testing.assert_array_equal(np.asarray(value), np.asarray(direct))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_log_probs_match_the_oracle(rng, api):
  """The modules' log_probs (and entropy) and their kernel gradient, with the
  module's loss options (smoothing, z-loss, fused mode) left out."""
  options = dict(logit_softcap=4.0, label_smoothing=0.1, z_loss=1e-3)
  options.update(logit_scale=0.8, grad_mode="fused", chunk_size=16)
  hidden, labels, where = _data(rng)
  g_lp, g_h = (jnp.asarray(rng.standard_normal(labels.shape)) for _ in range(2))

  def total(log_probs_fn, *args):
    lp, h = log_probs_fn(*args)
    return jnp.sum(lp * g_lp + h * g_h), (lp, h)

  if api == "nnx":
    head = mst_jax.nnx.LMHeadLoss(D, V, rngs=nnx.Rngs(1), **options)
    kernel = head.kernel[...]
    (_, (lp, h)), grads = nnx.value_and_grad(
      lambda head: total(
        functools.partial(head.log_probs, where=where, return_entropy=True),
        hidden,
        labels,
      ),
      has_aux=True,
    )(head)
    dkernel = grads["kernel"][...]
  else:
    head = mst_jax.linen.LMHeadLoss.create(V, **options)
    params = head.init(jax.random.key(1), hidden, labels)
    kernel = params["params"]["kernel"]

    def module(kernel):
      return head.apply(
        {"params": {"kernel": kernel}},
        hidden,
        labels,
        where=where,
        return_entropy=True,
        method="log_probs",
      )

    (_, (lp, h)), dkernel = jax.value_and_grad(
      functools.partial(total, module), has_aux=True
    )(kernel)

  def reference(kernel):
    return oracle64.log_probs(
      jnp.asarray(to64(hidden)),
      kernel,
      labels,
      where=where,
      weight_layout="dv",
      return_entropy=True,
      logit_softcap=4.0,
      logit_scale=0.8,
    )

  with jax.enable_x64(True):
    (_, (ref_lp, ref_h)), ref_dk = jax.value_and_grad(
      functools.partial(total, reference), has_aux=True
    )(jnp.asarray(to64(kernel)))
  for out, ref in ((lp, ref_lp), (h, ref_h), (dkernel, ref_dk)):
    assert_close(out, np.asarray(ref), 1e-4)


@pytest.mark.parametrize("scale", [None, 0.6])
def test_logits_match_the_loss(rng, scale):
  """``logits`` are what the loss sees: optax on them gives the same loss."""
  head = mst_jax.nnx.LMHeadLoss(
    D, V, rngs=nnx.Rngs(2), logit_softcap=4.0, logit_scale=scale
  )
  hidden, labels, _ = _data(rng)
  logits = head.logits(hidden)
  assert logits.shape == (3, 13, V)
  with jax.enable_x64(True):
    kernel = jnp.asarray(to64(head.kernel[...]))
    raw = (scale or 1.0) * (jnp.asarray(to64(hidden)) @ kernel)
    ref_logits = 4.0 * jnp.tanh(raw / 4.0)
    ref_loss = optax.softmax_cross_entropy_with_integer_labels(
      ref_logits, labels
    ).mean()
  assert_close(logits, np.asarray(ref_logits), LOSS_RTOL["float32"], "logits")
  assert_close(head(hidden, labels), np.asarray(ref_loss), LOSS_RTOL["float32"], "loss")


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_dtype_and_param_dtype_behave_as_in_flax(rng, api):
  """bf16 computation on float32 parameters: float32 loss, float32 gradients."""
  hidden, labels, where = _data(rng)
  if api == "nnx":
    head = mst_jax.nnx.LMHeadLoss(D, V, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    kernel = head.kernel[...]
    value, grads = nnx.value_and_grad(lambda m: m(hidden, labels, where=where))(head)
    dkernel = grads["kernel"][...]
  else:
    head = mst_jax.linen.LMHeadLoss(V, dtype=jnp.bfloat16)
    params = head.init(jax.random.key(3), hidden, labels)
    kernel = params["params"]["kernel"]
    value, grads = jax.value_and_grad(
      lambda p: head.apply(p, hidden, labels, where=where)
    )(params)
    dkernel = grads["params"]["kernel"]
  assert kernel.dtype == jnp.float32 and dkernel.dtype == jnp.float32
  assert value.dtype == jnp.float32
  # The oracle sees what the module computes with: bf16-rounded inputs.
  ref, (ref_dk,) = _oracle(
    hidden.astype(jnp.bfloat16),
    kernel.astype(jnp.bfloat16),
    labels,
    None,
    where,
    "dv",
    (1,),
  )
  # The module's logits are bfloat16, as a bfloat16 Dense head's are.
  bf16 = Problem(
    hidden.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), labels, None, where
  )
  rounding, _ = _logits_rounding(bf16, {"weight_layout": "dv"})
  assert_close(value, ref, LOSS_RTOL["bfloat16"], "loss", atol=rounding)
  # dkernel rounds like a bfloat16 Dense head's (its error within a multiple).
  _, (_, naive_dk) = naive_head(bf16, weight_layout="dv")
  allowed = NAIVE_FACTOR["dweight"] * np.linalg.norm(naive_dk - ref_dk)
  allowed += NAIVE_FLOOR * np.linalg.norm(ref_dk)
  assert_close(dkernel, ref_dk, 0.0, "dkernel", atol=allowed)


class _TinyNNX(nnx.Module):
  def __init__(self, tied, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.mix = nnx.Linear(D, D, rngs=rngs)
    self.head = mst_jax.nnx.LMHeadLoss(
      D, V, embedding=self.embed if tied else None, rngs=rngs
    )

  def __call__(self, tokens, labels):
    return self.head(jnp.tanh(self.mix(self.embed(tokens))), labels)


def test_nnx_jit_train_step_with_optax(rng):
  model = _TinyNNX(tied=False, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jnp.asarray(rng.integers(0, V, (4, 16)), jnp.int32)
  labels = jnp.roll(tokens, -1, axis=1)  # learnable: the next token of a fixed batch

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: m(tokens, labels))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.7 * losses[0], losses


def test_tied_embedding_gets_gradient_from_both_uses(rng):
  model = _TinyNNX(tied=True, rngs=nnx.Rngs(0))
  assert model.head.kernel is None
  tokens = jnp.asarray(rng.integers(0, V, (3, 11)), jnp.int32)
  labels = jnp.asarray(rng.integers(0, V, (3, 11)), jnp.int32)
  grads = nnx.grad(lambda m: m(tokens, labels))(model)
  table, w, b = (model.embed.embedding[...], model.mix.kernel[...], model.mix.bias[...])
  with jax.enable_x64(True):

    def reference(table):
      hidden = jnp.tanh(table[tokens] @ jnp.asarray(to64(w)) + jnp.asarray(to64(b)))
      return oracle64.cross_entropy(hidden, table, labels)

    ref = np.asarray(jax.grad(reference)(jnp.asarray(to64(table))))
  dtable = grads["embed"]["embedding"][...]
  assert_close(dtable, ref, GRAD_RTOL["float32"], "dtable")
  # The oracle counts both uses; rows never looked up still get the head's.
  unused = np.setdiff1d(np.arange(V), np.asarray(tokens))
  assert np.abs(ref[unused]).sum() > 0


class _TinyLinen(nn.Module):
  @nn.compact
  def __call__(self, tokens, labels):
    embed = nn.Embed(V, D)
    hidden = jnp.tanh(nn.Dense(D)(embed(tokens)))
    return mst_jax.linen.LMHeadLoss(V)(hidden, labels, embedding=embed.embedding)


def test_linen_tied_embedding_in_a_jit_train_step(rng):
  model = _TinyLinen()
  tokens = jnp.asarray(rng.integers(0, V, (4, 16)), jnp.int32)
  labels = jnp.roll(tokens, -1, axis=1)
  params = model.init(jax.random.key(0), tokens, labels)
  assert "LMHeadLoss_0" not in params["params"]  # tied: the head owns no kernel
  optimizer = optax.adam(1e-2)
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(lambda p: model.apply(p, tokens, labels))(params)
    updates, state = optimizer.update(grads, state)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(30):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses


def test_bad_module_arguments_raise_at_construction():
  with pytest.raises(ValueError, match=r"tied embedding table is \(1031, 24\)"):
    mst_jax.nnx.LMHeadLoss(
      D + 1, V, embedding=nnx.Embed(V, D, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)
    )
  with pytest.raises(ValueError, match="reduction.*'avg'"):
    mst_jax.nnx.LMHeadLoss(D, V, reduction="avg", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="z_loss"):
    mst_jax.linen.LMHeadLoss.create(V, z_loss=-1.0)
  with pytest.raises(ValueError, match="vocab_block_size"):
    mst_jax.linen.LMHeadLoss.create(V, vocab_block_size=0)
  with pytest.raises(TypeError, match="logits_dtype"):
    mst_jax.nnx.LMHeadLoss(D, V, logits_dtype="int32", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^LMHeadLoss got .*\['z_los'\]"):
    mst_jax.nnx.LMHeadLoss(D, V, z_los=1e-4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^LMHeadLoss.create\(\) got .*\['z_los'\]"):
    mst_jax.linen.LMHeadLoss.create(V, z_los=1e-4, use_bias=True)
  with pytest.raises(TypeError, match="weight_layout"):
    mst_jax.nnx.LMHeadLoss(D, V, weight_layout="vd", rngs=nnx.Rngs(0))
  head = mst_jax.linen.LMHeadLoss(V, options={"z_loss": 1e-4})
  with pytest.raises(TypeError, match="must be a mst_jax.HeadLossOptions"):
    head.init(jax.random.key(0), jnp.ones((4, D)), jnp.zeros((4,), jnp.int32))


@pytest.mark.parametrize(
  "module", ["mst_jax._losses.cross_entropy", "mst_jax.nnx", "mst_jax.linen"]
)
def test_docstring_examples_run(module):
  import importlib

  result = doctest.testmod(importlib.import_module(module))
  assert result.attempted > 0 and result.failed == 0
