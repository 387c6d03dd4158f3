"""Shared test helpers: random problems, the float64 oracle, tolerances."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mst_jax


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


# Relative error ||out - ref|| / ||ref|| allowed against the float64 oracle,
# keyed by input dtype. Logits accumulate in float32 from exact products, so
# the loss is float32-accurate for every input dtype; gradients pass through
# dlogits and a matmul output in the input dtype.
CPU_LOSS_RTOL = {"float32": 2e-6, "bfloat16": 2e-6, "float16": 2e-6, "float64": 1e-12}
CPU_GRAD_RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
# On a GPU, float32 matmuls may run in TF32 (10-bit mantissa) and reductions
# sum in another order.
GPU_LOSS_RTOL = {**CPU_LOSS_RTOL, "float32": 2e-4, "bfloat16": 2e-5, "float16": 2e-5}
GPU_GRAD_RTOL = {**CPU_GRAD_RTOL, "float32": 3e-3, "float64": 1e-10}
ON_GPU = has_gpu()
LOSS_RTOL = GPU_LOSS_RTOL if ON_GPU else CPU_LOSS_RTOL
GRAD_RTOL = GPU_GRAD_RTOL if ON_GPU else CPU_GRAD_RTOL

_SEEDS = itertools.count(np.random.SeedSequence().entropy % (2**31))


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng():
  """A fresh numpy Generator per test; the seed is printed on failure."""
  seed = next(_SEEDS)
  print(f"numpy seed: {seed}")
  return np.random.default_rng(seed)


@dataclasses.dataclass
class Problem:
  hidden: jax.Array
  weight: jax.Array
  labels: jax.Array
  bias: jax.Array | None
  where: jax.Array | None

  @property
  def args(self):
    return self.hidden, self.weight, self.labels, self.bias


def make_problem(
  rng,
  batch_shape=(37,),
  dim=24,
  vocab=1031,
  dtype="float32",
  *,
  mask="scattered",
  bias=False,
  weight_layout="vd",
  ignore_index=-100,
  logit_scale=3.0,
) -> Problem:
  """A random problem whose logits have standard deviation ~``logit_scale``.

  ``mask``: "none" (every token counts), "prefix" (the first ~half of each
  sequence is ``ignore_index``), "scattered" (``where`` drops ~40% at random)
  or "all" (every token excluded).
  """
  hidden = rng.standard_normal((*batch_shape, dim))
  weight = rng.standard_normal((vocab, dim)) * logit_scale / np.sqrt(dim)
  if weight_layout == "dv":
    weight = weight.T
  labels = rng.integers(0, vocab, batch_shape)
  where = None
  if mask == "prefix":
    seq = batch_shape[-1]
    cut = rng.integers(seq // 3, 2 * seq // 3 + 1, batch_shape[:-1] or (1,))
    prefix = np.arange(seq) < cut.reshape(-1, 1)
    labels = np.where(prefix.reshape(batch_shape), ignore_index, labels)
  elif mask == "scattered":
    where = rng.random(batch_shape) > 0.4
  elif mask == "all":
    where = np.zeros(batch_shape, bool)
  elif mask != "none":
    raise ValueError(mask)
  b = rng.standard_normal(vocab) * 0.5 if bias else None
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return Problem(
    hidden=cast(hidden),
    weight=cast(weight),
    labels=jnp.asarray(labels, jnp.int32),
    bias=cast(b),
    where=None if where is None else jnp.asarray(where),
  )


def _diff_argnums(problem):
  return (0, 1, 3) if problem.bias is not None else (0, 1)


def value_and_grads(fn, problem, **kwargs):
  """Loss and gradients (hidden, weight[, bias]) of ``fn`` on ``problem``."""

  def loss(hidden, weight, labels, bias):
    out = fn(hidden, weight, labels, bias, where=problem.where, **kwargs)
    return jnp.sum(out) if kwargs.get("reduction") == "none" else out

  return jax.value_and_grad(loss, argnums=_diff_argnums(problem))(*problem.args)


def to64(x):
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def oracle(problem, **kwargs):
  """Loss and gradients from the full-logits reference in float64."""
  chunked_only = ("impl", "chunk_size", "memory_budget", "accum_dtype", "grad_mode")
  kwargs = {k: v for k, v in kwargs.items() if k not in chunked_only}
  with jax.enable_x64(True):
    p64 = dataclasses.replace(
      problem,
      hidden=jnp.asarray(to64(problem.hidden)),
      weight=jnp.asarray(to64(problem.weight)),
      bias=None if problem.bias is None else jnp.asarray(to64(problem.bias)),
    )
    loss, grads = value_and_grads(mst_jax.reference.linear_cross_entropy, p64, **kwargs)
    return np.asarray(loss), [np.asarray(g) for g in grads]


def rel_err(out, ref) -> float:
  out, ref = to64(out), np.asarray(ref, np.float64)
  num = np.linalg.norm((out - ref).ravel())
  den = np.linalg.norm(ref.ravel())
  if den == 0.0:
    return float(num)
  return float(num / den)


def assert_close(out, ref, rtol, what=""):
  out64 = to64(out)
  assert out64.shape == np.shape(ref), (what, out64.shape, np.shape(ref))
  assert not np.isnan(out64).any(), f"{what}: NaN in output"
  err = rel_err(out, ref)
  assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:.3g}"


def check_against_oracle(problem, dtype, *, loss_rtol=None, grad_rtol=None, **kwargs):
  """Runs ``mst_jax.linear_cross_entropy`` and compares with the oracle."""
  loss, grads = value_and_grads(mst_jax.linear_cross_entropy, problem, **kwargs)
  ref_loss, ref_grads = oracle(problem, **kwargs)
  assert loss.dtype == jnp.float32
  assert_close(loss, ref_loss, loss_rtol or LOSS_RTOL[dtype], "loss")
  names = ("dhidden", "dweight", "dbias")[: len(grads)]
  inputs = (problem.hidden, problem.weight, problem.bias)[: len(grads)]
  for name, x, g, ref in zip(names, inputs, grads, ref_grads, strict=True):
    assert g.dtype == x.dtype, (name, g.dtype, x.dtype)
    assert_close(g, ref, grad_rtol or GRAD_RTOL[dtype], name)
  return loss, grads
