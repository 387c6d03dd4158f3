"""XLA:CPU: the matmuls in vocabulary tiles, and compiled memory within the budget.

XLA:CPU computes 16-bit matmuls and elementwise updates in float32 and
converts their operands whole, so on the CPU the matmuls go tile by tile
(``_gemm.matmul``, ``HeadSpec.matmul_tile``) and the planner counts what the CPU
holds besides (``_plan.cpu_fixed_bytes``, ``CPU_COPY_BYTES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, check_against_oracle, make_problem

import mst_jax
from mst_jax import _plan
from mst_jax._gemm import matmul

pytestmark = pytest.mark.skipif(ON_GPU, reason="XLA:CPU programs")

_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("width, tile", [(1031, 96), (200, 50), (37, 64)])
def test_tiled_matmuls_match_float64(rng, layout, dtype, width, tile):
  """Each matmul tiled (a remainder tile, one tile wider than the width)."""
  rows, dim = 19, 24
  hidden = jnp.asarray(rng.standard_normal((rows, dim)), dtype)
  weight = rng.standard_normal((width, dim))
  weight = jnp.asarray(weight if layout == "vd" else weight.T, dtype)
  bias = jnp.asarray(rng.standard_normal(width), dtype)
  dlogits = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  start = jnp.asarray(rng.standard_normal(weight.shape), dtype)
  w64 = _f64(weight) if layout == "vd" else _f64(weight).T  # [V, D]
  product = _f64(dlogits).T @ _f64(hidden)  # [V, D]
  product = product if layout == "vd" else product.T
  tol = _TOL[dtype]

  def close(out, ref, what):
    out = _f64(out)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < tol, (what, err)

  logits = jax.jit(
    lambda h, w, b: matmul.logits_matmul(h, w, b, layout, jnp.float32, tile=tile)
  )(hidden, weight, bias)
  close(logits, _f64(hidden) @ w64.T + _f64(bias), "logits")
  dh = jax.jit(lambda d, w: matmul.dhidden_matmul(d, w, layout, dtype, tile=tile))(
    dlogits, weight
  )
  close(dh, _f64(dlogits) @ w64, "dhidden")
  for add in (True, False):
    dw = jax.jit(
      lambda d, h, w, add=add: matmul.dweight_matmul(
        d, h, layout, jnp.float32, into=w.astype(jnp.float32), add=add, tile=tile
      )
    )(dlogits, hidden, start)
    close(dw, product + (_f64(start) if add else 0.0), f"dweight add={add}")


@pytest.fixture
def small_tiles(monkeypatch):
  """Tiles of 96 columns, whatever the weight's size. The plan reads the
  constants at trace time, and they are not part of jax.jit's cache key, so
  the tests using them have shapes of their own (D=13, 3 x 41 tokens: no
  other test traces them)."""
  monkeypatch.setattr(_plan, "MATMUL_TILE", 96)
  monkeypatch.setattr(_plan, "UNTILED_SHARE", 2**62)


@pytest.mark.parametrize(
  "weight_layout, options",
  [
    ("vd", {}),
    ("dv", {"grad_mode": "recompute", "label_smoothing": 0.1}),
    ("vd", {"memory_budget": 64 * 1031 * 2, "z_loss": 1e-3}),  # several groups
    ("dv", {"chunk_size": 16, "logit_softcap": 5.0}),
    ("dv", {"vocab_block_size": 256, "chunk_size": 32}),
  ],
)
def test_tiled_loss_matches_the_oracle(rng, small_tiles, weight_layout, options):
  problem = make_problem(
    rng, (3, 41), dim=13, dtype="bfloat16", bias=True, weight_layout=weight_layout
  )
  check_against_oracle(
    problem, "bfloat16", impl="xla", weight_layout=weight_layout, **options
  )


_D, _V = 4096, 128256


def _temps(n_rows, dtype, fn, dim=_D, vocab=_V):
  shapes = (
    jax.ShapeDtypeStruct((n_rows, dim), dtype),
    jax.ShapeDtypeStruct((vocab, dim), dtype),
    jax.ShapeDtypeStruct((n_rows,), jnp.int32),
  )
  step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
  return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def _naive(hidden, weight, labels):
  logits = (hidden @ weight.T).astype(jnp.float32)
  target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


@pytest.mark.parametrize(
  "n_rows, dtype, budget",
  [
    (8192, jnp.bfloat16, None),
    (8192, jnp.bfloat16, 512 << 20),
    (8192, jnp.bfloat16, 1 << 30),
    (32768, jnp.bfloat16, None),
    (32768, jnp.bfloat16, 512 << 20),
    (32768, jnp.bfloat16, 1 << 30),
    (8192, jnp.float32, None),
    (32768, jnp.float32, 512 << 20),
  ],
)
def test_llama_head_temporaries_within_budget(n_rows, dtype, budget):
  """Compiled (not run) at the Llama-3 head: temporaries <= 1.15x the budget."""
  options = {} if budget is None else {"memory_budget": budget}
  temps = _temps(
    n_rows,
    dtype,
    lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **options),
  )
  limit = 1.15 * (budget or _plan.DEFAULT_MEMORY_BUDGET)
  assert temps <= limit, (temps / 2**20, limit / 2**20)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("budget", [None, 1 << 30])
def test_untiled_head_temporaries_within_budget(dtype, budget):
  """A narrow head whose matmuls run untiled (``_plan.matmul_tile``), its
  logits beyond the budget: temporaries <= 1.15x the budget."""
  dim, vocab = 64, 151552
  default = _plan.DEFAULT_MEMORY_BUDGET
  assert _plan.matmul_tile("cpu", vocab, dim, budget or default) is None
  options = {} if budget is None else {"memory_budget": budget}
  temps = _temps(
    4096,
    dtype,
    lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **options),
    dim=dim,
    vocab=vocab,
  )
  limit = 1.15 * (budget or default)
  assert temps <= limit, (temps / 2**20, limit / 2**20)


def test_a_float32_accumulator_asked_for_counts_in_the_budget():
  """``accum_dtype=jnp.float32`` at the Llama-3 head: its 2 GiB buffer is
  counted in the default budget, the rows planned in the rest."""
  temps = _temps(
    8192,
    jnp.bfloat16,
    lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, accum_dtype=jnp.float32),
  )
  limit = 1.15 * _plan.DEFAULT_MEMORY_BUDGET
  assert temps <= limit, (temps / 2**20, limit / 2**20)


@pytest.mark.parametrize("n_rows, fraction", [(8192, 0.5), (32768, 0.15)])
def test_llama_head_default_saves_against_full_logits(n_rows, fraction):
  ours = _temps(n_rows, jnp.bfloat16, mst_jax.linear_cross_entropy)
  naive = _temps(n_rows, jnp.bfloat16, _naive)
  assert ours <= fraction * naive, (ours / 2**20, naive / 2**20)
