"""``dweight`` as a compensated sum (``_matmul.Compensated``).

Where a float32 ``dweight`` accumulator would take more than half the memory
budget and the Mosaic GEMM sums a compensated pair in place, the planner
keeps ``dweight`` as two arrays of the weight's 16-bit dtype (the sum and its
rounding error) instead of rounding it once per group. The pair's arithmetic
and the sweep that carries it run on the CPU (XLA's ``dot_general`` adds the
products there); the Mosaic kernel's epilogue needs a Hopper GPU. Every case
compares against float64 on fresh random inputs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mst_jax
from mst_jax import _api, _matmul, _mosaic_gemm, _planning
from mst_jax._mosaic_gemm import GemmConfig

BF16 = np.dtype(jnp.bfloat16)


def _relative(x, ref) -> float:
  x = np.asarray(x, np.float64)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_pair_keeps_sixteen_bits(rng):
  """Many products added to a bfloat16 pair: as close as float32 sums, where
  rounding each sum to bfloat16 loses about 3 more bits."""
  parts = [rng.standard_normal((257, 96)).astype(np.float32) for _ in range(64)]
  exact = np.sum(np.asarray(parts, np.float64), axis=0)
  pair = _matmul.Compensated.zeros(exact.shape, jnp.bfloat16)
  rounded = jnp.zeros(exact.shape, jnp.bfloat16)
  for part in parts:
    pair = pair.add(jnp.asarray(part))
    rounded = (rounded + part).astype(jnp.bfloat16)
  high, low = (np.asarray(x, np.float64) for x in pair)
  assert _relative(high + low, exact) < 2e-5
  assert np.all(np.abs(low) <= np.abs(high) * 2.0**-8)  # half an ulp, at most
  # The pair's high part is the exact sum rounded once; in place, 64 times.
  once = _relative(np.asarray(exact.astype(jnp.bfloat16), np.float64), exact)
  assert _relative(high, exact) <= 1.01 * once < _relative(rounded, exact) / 3


def test_planned_where_float32_does_not_fit():
  """The Llama-3 head at 32768 tokens and the default budget: a float32
  accumulator (2 GiB) takes more than half; the low part (1 GiB) comes out of
  the budget and the groups are planned in the rest."""
  n, v, d, budget = 32768, 128256, 4096, _planning.DEFAULT_MEMORY_BUDGET
  plan = lambda compensate, budget=budget: _planning.plan_with_accumulator(
    n, v, d, BF16, BF16, memory_budget=budget, logits_dtype=BF16, compensate=compensate
  )
  chunk, group, accum = plan(True)
  assert accum == _planning.COMPENSATED
  assert (group + chunk) * v * 2 + v * d * 2 <= budget
  assert plan(False)[2] is None  # in place, a rounding per group
  # A float32 accumulator within half the budget is still preferred.
  assert plan(True, budget=4 << 30)[2] == np.float32
  # Without room for the low part either: in place.
  assert plan(True, budget=v * d * 3)[2] is None


def test_only_where_the_mosaic_gemm_sums_in_place():
  assert _matmul.compensates(128256, 4096, BF16, "mosaic") == (
    _mosaic_gemm.unavailable_reason() is None
  )
  assert not _matmul.compensates(128256, 4096, BF16, "xla")


def _problem(rng, n, d, v, layout):
  hidden = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((v, d)) * 0.3, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, v, n))
  where = jnp.asarray(rng.random(n) > 0.2)
  return hidden, weight if layout == "vd" else weight.T, labels, where


def _dweight(hidden, weight, labels, where, **options):
  layout = "vd" if weight.shape[1] == hidden.shape[1] else "dv"
  loss = lambda w: mst_jax.linear_cross_entropy(
    hidden, w, labels, where=where, reduction="sum", weight_layout=layout, **options
  )
  return jax.jit(jax.grad(loss))(weight)


@pytest.mark.parametrize("grad_mode", ["fused", "recompute"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_sweep_matches_a_float32_accumulator(rng, monkeypatch, layout, grad_mode):
  """The whole sweep with a compensated ``dweight`` (forced on the CPU: XLA
  adds each group's float32 product to the pair): 16 groups of 128 rows
  (with excluded rows, so some go chunk by chunk), ``dweight`` as accurate
  as with a float32 accumulator, and clearly more than rounded in place."""
  monkeypatch.setattr(_api, "_platform", lambda layout: "gpu")  # untiled plans
  monkeypatch.setattr(_matmul, "compensates", lambda *args: True)
  n, d, v = 2000, 64, 4096
  hidden, weight, labels, where = _problem(rng, n, d, v, layout)
  x64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
  with jax.enable_x64():
    ref = _dweight(x64(hidden), x64(weight), labels, where, impl="reference")
  ref = np.asarray(ref)
  # A float32 accumulator (1 MiB) over half the budget, the low part within.
  options = dict(memory_budget=3 << 19, grad_mode=grad_mode, impl="xla")
  errors = {
    accum: _relative(
      _dweight(hidden, weight, labels, where, accum_dtype=accum, **options), ref
    )
    for accum in (None, jnp.float32, jnp.bfloat16)
  }
  assert errors[None] <= 1.02 * errors[jnp.float32]
  assert errors[jnp.bfloat16] > 2 * errors[jnp.float32]


def test_lowers_to_the_compensated_gemm(as_if_on_hopper):
  """On a Hopper GPU the planned pair goes into the Mosaic GEMM: one call
  with both parts as operands (lhs, rhs, high, low)."""
  h = jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((32000, 256), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((4096,), jnp.int32)

  def operand_counts(**options):
    loss = lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **options)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    return [len(c.split(",")) for c in calls]

  assert 4 in operand_counts(memory_budget=48 << 20)  # 8 groups of 512 rows
  assert 4 not in operand_counts()  # one group: nothing to sum


def test_rejects_a_bad_low_part():
  x = jnp.zeros((64, 128), jnp.bfloat16)
  dims = (((1,), (1,)), ((), ()))
  with pytest.raises(ValueError, match="pass accumulate"):
    _mosaic_gemm.matmul(x, x, dims, low=jnp.zeros((64, 64), jnp.bfloat16))
  acc = jnp.zeros((64, 64), jnp.float32)
  with pytest.raises(TypeError, match="16-bit"):
    _mosaic_gemm.matmul(x, x, dims, accumulate=acc, low=acc)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "config",
  [None, GemmConfig(stages=3, epilogue_m=128, epilogue_n=32)],
  ids=["default", "cooperative"],
)
@pytest.mark.parametrize("rows", [264, 1000])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_mosaic_gemm_sums_the_pair(rng, layout, rows, config):
  """Eight ``dweight`` products summed into a pair by the Mosaic GEMM's
  epilogue, against float64: the pair to float32 accuracy, its high part
  the sum rounded once (a short and a longer contraction, unaligned)."""
  d, v = 320, 4160
  dims = (((0,), (0,)), ((), ()))
  shape = (v, d) if layout == "vd" else (d, v)
  pair = _matmul.Compensated.zeros(shape, jnp.bfloat16)
  exact = np.zeros(shape)
  for _ in range(8):
    dlogits = jnp.asarray(rng.standard_normal((rows, v)), jnp.bfloat16)
    hidden = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
    lhs, rhs = (dlogits, hidden) if layout == "vd" else (hidden, dlogits)
    exact += np.asarray(lhs, np.float64).T @ np.asarray(rhs, np.float64)
    pair = _matmul.Compensated(
      *_mosaic_gemm.matmul(
        lhs, rhs, dims, accumulate=pair.high, low=pair.low, config=config
      )
    )
  high, low = (np.asarray(x, np.float64) for x in pair)
  assert _relative(high + low, exact) < 2e-5
  once = _relative(np.asarray(exact.astype(jnp.bfloat16), np.float64), exact)
  assert _relative(high, exact) <= 1.01 * once
