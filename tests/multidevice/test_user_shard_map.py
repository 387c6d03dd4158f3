"""Multi-device: the losses inside the caller's own ``jax.shard_map``.

Each device computes its rows' loss and the caller sums over the axis (the
"Gradient accumulation" pattern of docs/api.md). With JAX's default
``check_vma=True`` every value's type records the axes it varies over; the
weight, the same on every device, gets its gradient summed over them by the
``shard_map``'s autodiff, as a naive head's would. Both settings of
``check_vma`` are checked against the float64 reference of the whole problem.
Run by ``tests/test_multidevice.py`` on 8 simulated CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import GRAD_RTOL, LOSS_RTOL, assert_close, make_problem, oracle, to64
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mst_jax

D, V = 8, 1001
ROWS = (8, 7)  # 14 rows on each of 4 devices: at least D, so every gradient mode


def _mesh(axis_types=AxisType.Auto):
  return jax.make_mesh((4,), ("data",), axis_types=(axis_types,))


def _in_shard_map(per_device, check_vma, n_sharded, n_replicated):
  """``per_device(*sharded, *replicated)`` summed over 4 devices: the
  ``n_sharded`` arrays split over them by rows, the ``n_replicated`` ones the
  same on each."""

  def summed(*args):
    return lax.psum(per_device(*args), "data")

  specs = (*[P("data")] * n_sharded, *[P()] * n_replicated)
  return jax.shard_map(
    summed, mesh=_mesh(), in_specs=specs, out_specs=P(), check_vma=check_vma
  )


# Chunks of 4 rows unless a case says otherwise.
CE_CASES = {
  "fused": dict(),  # the default for a scalar loss
  "recompute": dict(grad_mode="recompute", logit_softcap=5.0),
  # Per-token losses keep the forward's logits when the rows fit as one group.
  "kept_none": dict(reduction="none", chunk_size=None, label_smoothing=0.1),
  "vocab_blocks": dict(vocab_block_size=256, label_smoothing=0.1),
  "dv_bias": dict(weight_layout="dv", z_loss=1e-3),
  "pallas": dict(impl="pallas", label_smoothing=0.1),
}
# Options of the chunked paths only, not the reference's.
CHUNKED = ("impl", "chunk_size", "vocab_block_size")


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check"])
@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_in_a_shard_map(rng, case, check_vma):
  options = {k: v for k, v in (dict(chunk_size=4) | CE_CASES[case]).items() if v}
  layout = options.get("weight_layout", "vd")
  problem = make_problem(
    rng, ROWS, dim=D, vocab=V, bias=case == "dv_bias", weight_layout=layout
  )
  reduction = options.pop("reduction", "sum")

  def per_device(hidden, labels, where, weight, bias=None):
    out = mst_jax.linear_cross_entropy(
      hidden, weight, labels, bias, where=where, reduction=reduction, **options
    )
    return jnp.sum(out)

  bias = () if problem.bias is None else (problem.bias,)
  loss = _in_shard_map(per_device, check_vma, 3, 1 + len(bias))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4)[: 2 + len(bias)]))
  args = (problem.hidden, problem.labels, problem.where, problem.weight, *bias)
  if case == "pallas" and check_vma:  # its kernels' outputs carry no axes
    with pytest.raises(ValueError, match="check_vma=False"):
      step(*args)
    return
  value, grads = step(*args)
  reference = {k: v for k, v in options.items() if k not in CHUNKED}
  ref_value, ref_grads = oracle(problem, reduction="sum", **reference)
  assert_close(value, ref_value, LOSS_RTOL["float32"], "loss")
  names = ("dhidden", "dweight", "dbias")[: len(grads)]
  for name, g, ref in zip(names, grads, ref_grads, strict=True):
    assert_close(g, ref, GRAD_RTOL["float32"], name)


def _float64_value_and_grad(fn, *args):
  """``fn``'s value and gradient wrt its first two arguments, in float64."""
  with jax.enable_x64(True):
    wide = [
      jnp.asarray(to64(x)) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in args
    ]
    value, grads = jax.value_and_grad(fn, argnums=(0, 1))(*wide)
    return np.asarray(value), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check"])
def test_log_probs_in_a_shard_map(rng, check_vma):
  problem = make_problem(rng, ROWS, dim=D, vocab=V)
  cotangent = jnp.asarray(rng.standard_normal(ROWS), jnp.float32)

  def weighted(fn, hidden, weight, labels, where, cotangent, size=jnp.asarray):
    log_probs, entropy = fn(hidden, weight, labels, where=where, return_entropy=True)
    return jnp.sum(size(log_probs * cotangent) + size(0.1 * entropy))

  def per_device(hidden, labels, where, cotangent, weight):
    # The default keeps the forward's logits for the backward here.
    return weighted(mst_jax.linear_log_probs, hidden, weight, labels, where, cotangent)

  loss = _in_shard_map(per_device, check_vma, 4, 1)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 4)))
  value, grads = step(
    problem.hidden, problem.labels, problem.where, cotangent, problem.weight
  )
  args = (problem.hidden, problem.weight, problem.labels, problem.where, cotangent)
  ref_value, ref_grads = _float64_value_and_grad(
    lambda h, w, *rest: weighted(oracle64.log_probs, h, w, *rest), *args
  )
  # The sum cancels (random signed cotangents): its error is relative to
  # the terms' magnitudes.
  magnitude, _ = _float64_value_and_grad(
    lambda h, w, *rest: weighted(oracle64.log_probs, h, w, *rest, size=jnp.abs), *args
  )
  rtol = LOSS_RTOL["float32"]
  assert_close(value, ref_value, rtol, "loss", atol=rtol * float(magnitude))
  for name, g, ref in zip(("dhidden", "dweight"), grads, ref_grads, strict=True):
    assert_close(g, ref, GRAD_RTOL["float32"], name)


@pytest.mark.parametrize("grad_mode", [None, "recompute"], ids=["fused", "recompute"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check"])
def test_distillation_in_a_shard_map(rng, check_vma, grad_mode):
  """A teacher with another hidden size, its weight the same on each device."""
  problem = make_problem(rng, ROWS, dim=D, vocab=V)
  teacher_hidden = jnp.asarray(rng.standard_normal((*ROWS, 24)), jnp.float32)
  teacher_weight = jnp.asarray(rng.standard_normal((V, 24)) * 0.5, jnp.float32)
  options = dict(
    divergence="jsd", beta=0.3, temperature=2.0, hard_label_weight=0.5, reduction="sum"
  )

  def per_device(hidden, teacher_hidden, labels, where, weight, teacher_weight):
    heads = (hidden, weight, teacher_hidden, teacher_weight)
    loss = mst_jax.linear_distillation_loss
    return loss(
      *heads, labels, where=where, chunk_size=4, grad_mode=grad_mode, **options
    )

  loss = _in_shard_map(per_device, check_vma, 4, 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 4)))
  value, grads = step(
    problem.hidden,
    teacher_hidden,
    problem.labels,
    problem.where,
    problem.weight,
    teacher_weight,
  )
  ref_value, ref_grads = _float64_value_and_grad(
    lambda h, w, th, tw, y, where: oracle64.distillation(
      h, w, th, tw, y, where=where, **options
    ),
    problem.hidden,
    problem.weight,
    teacher_hidden,
    teacher_weight,
    problem.labels,
    problem.where,
  )
  assert_close(value, ref_value, LOSS_RTOL["float32"], "loss")
  for name, g, ref in zip(("dhidden", "dweight"), grads, ref_grads, strict=True):
    assert_close(g, ref, GRAD_RTOL["float32"], name)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check"])
def test_the_gpu_program_in_a_shard_map_lowers_for_cuda(as_if_on_hopper, check_vma):
  """On a Hopper GPU: the Mosaic kernels with ``check_vma=False``; with
  ``check_vma=True``, where their outputs would carry no manual axes, XLA's
  GEMMs and per-chunk backend (and no Triton kernel either way)."""
  h = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((2048, 64), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((256,), jnp.int32)

  def per_device(hidden, labels, weight):
    return mst_jax.linear_cross_entropy(
      hidden, weight, labels, reduction="sum", chunk_size=64
    )

  loss = _in_shard_map(per_device, check_vma, 2, 1)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
  text = step.trace(h, y, w).lower(lowering_platforms=("cuda",)).as_text()
  assert ("mst_jax_mosaic_gemm" in text) is not check_vma
  assert "triton" not in text
