"""A bias at a vocabulary of other widths than whole 64-column tiles (GPT-2's
50257, 1001 here) on the Mosaic kernels.

The Mosaic GEMM writes the chunk's float32 logits padded to whole tiles
(``_gemm.matmul.mosaic_logits``), the bias is added with zeros past its columns,
the cross-entropy and distillation kernels score the weight's columns, and
``dbias`` sums the weight's columns of the padded ``dlogits``
(``_gemm.matmul.bias_gradient``). On a CPU: the step lowered for CUDA has no XLA
GEMM and no Triton kernel, and the same program run with the GEMM as an XLA
product of the same contract and the kernels in interpret mode matches the
float64 oracle. On a Hopper GPU: the real kernels against the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracle as oracle64
import pytest
from conftest import ALL_OPTIONS, check_against_oracle, make_problem, rel_err

import mst_jax
from mst_jax._gemm.mosaic import gemm as mosaic_gemm


def _biased_problem(rng, batch_shape, dim, vocab, layout, **kwargs):
  """A bfloat16 ``make_problem`` with a bias."""
  return make_problem(
    rng,
    batch_shape,
    dim=dim,
    vocab=vocab,
    dtype="bfloat16",
    bias=True,
    weight_layout=layout,
    **kwargs,
  )


@pytest.mark.parametrize(
  "layout, kwargs",
  [
    ("vd", dict()),
    ("vd", dict(chunk_size=64, grad_mode="recompute", **ALL_OPTIONS)),
    ("vd", dict(memory_budget=1 << 19)),  # whole groups' buffers
    ("vd", dict(chunk_size=64, vocab_block_size=384, z_loss=1e-3)),
    ("vd", dict(reduction="none", label_smoothing=0.1)),  # kept logits
    ("dv", dict(chunk_size=64)),  # transposed once per step
  ],
  ids=str,
)
def test_a_bias_at_a_ragged_vocabulary_matches_the_oracle(
  rng, mosaic_on_cpu, layout, kwargs
):
  """1001 columns padded to 1024 (with vocabulary blocks of 384, the last
  block's 233 to 256), the bias and its gradient against the float64 oracle
  in every loop order."""
  problem = _biased_problem(rng, (2, 150), 128, 1001, layout)
  check_against_oracle(
    problem, "bfloat16", impl="mosaic", weight_layout=layout, **kwargs
  )
  padded = 256 if "vocab_block_size" in kwargs else 1024
  assert padded in mosaic_on_cpu  # the logits GEMM wrote padded logits


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(grad_mode="recompute", logits_dtype=jnp.float32),
    dict(chunk_size=256, vocab_block_size=8192),
    dict(reduction="none"),
  ],
  ids=str,
)
def test_a_bias_at_gpt2s_vocabulary_lowers_to_mosaic_kernels_only(
  as_if_on_hopper, layout, kwargs
):
  """At 50257 columns with a bias: every product and the cross-entropy on
  Mosaic GPU kernels, no XLA GEMM and no Triton kernel; the statistics in a
  kernel of their own (the GEMM's epilogue sees no bias); a ``[D, V]``
  weight transposed once per step and its gradient back."""
  n, d, vocab = 1000, 256, 50257
  h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((vocab, d) if layout == "vd" else (d, vocab), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((vocab,), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)

  def loss(h, w, b, y):
    out = mst_jax.linear_cross_entropy(h, w, y, b, weight_layout=layout, **kwargs)
    return jnp.sum(out)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  text = step.trace(h, w, b, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "mst_ce_stats_mosaic" in text and "_rows_mosaic" not in text
  assert "triton" not in text and "stablehlo.dot_general" not in text
  assert text.count("stablehlo.transpose") == (0 if layout == "vd" else 2)


def _distill_heads(rng, vocab, dtype, layout, n=300, d_s=128, d_t=256):
  """``(student h, w, teacher h, w, student bias, teacher bias)`` and labels."""
  teacher = rng.standard_normal((n, d_t))
  student = teacher @ rng.standard_normal((d_t, d_s)) / np.sqrt(d_t)
  w_s = rng.standard_normal((vocab, d_s)) * 3 / np.sqrt(d_s)
  w_t = rng.standard_normal((vocab, d_t)) * 3 / np.sqrt(d_t)
  if layout == "dv":
    w_s, w_t = w_s.T, w_t.T
  b_s, b_t = rng.standard_normal(vocab), rng.standard_normal(vocab)
  heads = [jnp.asarray(x, dtype) for x in (student, w_s, teacher, w_t, b_s, b_t)]
  return heads, jnp.asarray(rng.integers(0, vocab, n), jnp.int32)


def _distill_step(fn, labels, **options):
  """The loss and the student's ``(dhidden, dweight, dbias)``."""

  def loss(h, w, t, wt, b, bt):
    return fn(h, w, t, wt, labels, student_bias=b, teacher_bias=bt, **options)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 4)))


# bfloat16 heads' logits round by up to 2^-9 of themselves: a fraction of a
# percent of the loss and of the gradients (test_mosaic_head's tolerances).
DISTILL_RTOL = {"loss": 1e-2, "grads": 3e-2}


def check_distillation(heads, labels, **options):
  """``linear_distillation_loss`` with both biases against the float64 oracle."""
  loss, grads = _distill_step(mst_jax.linear_distillation_loss, labels, **options)(
    *heads
  )
  with jax.enable_x64(True):
    heads64 = [jnp.asarray(np.asarray(x, np.float64)) for x in heads]
    oracle = oracle64.distillation
    options = {k: v for k, v in options.items() if k not in ("impl", "chunk_size")}
    ref_loss, ref_grads = _distill_step(oracle, labels, **options)(*heads64)
    ref_loss = float(ref_loss)  # outside x64, jnp would truncate it to float32
  assert abs(float(loss) - ref_loss) <= DISTILL_RTOL["loss"] * abs(ref_loss)
  for name, got, want in zip(
    ("dhidden", "dweight", "dbias"), grads, ref_grads, strict=True
  ):
    assert rel_err(got, want) <= DISTILL_RTOL["grads"], name


DISTILL_OPTIONS = [
  ("vd", dict(temperature=2.0)),
  ("vd", dict(divergence="jsd", hard_label_weight=0.3, chunk_size=64)),
  ("dv", dict(divergence="reverse_kl", chunk_size=64)),
]


@pytest.mark.parametrize("layout, options", DISTILL_OPTIONS, ids=str)
def test_distillation_with_biases_at_a_ragged_vocabulary(
  rng, mosaic_on_cpu, layout, options
):
  """Both heads' logits padded from 1001 to 1024 columns with their biases
  added; the student's three gradients against the float64 oracle."""
  heads, labels = _distill_heads(rng, 1001, jnp.bfloat16, layout)
  check_distillation(heads, labels, impl="mosaic", weight_layout=layout, **options)
  assert 1024 in mosaic_on_cpu


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_distillation_with_biases_lowers_to_mosaic_kernels_only(
  as_if_on_hopper, monkeypatch, layout
):
  """At 50257 columns with both biases: no XLA GEMM, no Triton kernel."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  vocab = 50257
  shape = lambda d: (vocab, d) if layout == "vd" else (d, vocab)
  structs = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16)
    for s in ((1000, 256), shape(256), (1000, 320), shape(320), (vocab,), (vocab,))
  ]
  labels = jnp.zeros((1000,), jnp.int32)
  step = _distill_step(
    mst_jax.linear_distillation_loss, labels, divergence="jsd", weight_layout=layout
  )
  text = step.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
  assert "custom_call @mosaic_gpu" in text
  assert "triton" not in text and "stablehlo.dot_general" not in text


def _skip_without_hopper():
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "layout, kwargs",
  [
    ("vd", dict()),
    ("vd", dict(chunk_size=256, grad_mode="recompute", **ALL_OPTIONS)),
    ("vd", dict(chunk_size=512, vocab_block_size=8192)),
    ("dv", dict(reduction="none", z_loss=1e-3)),
  ],
  ids=str,
)
def test_gpu_a_bias_at_gpt2s_vocabulary(rng, layout, kwargs):
  """The real kernels at 50257 columns with a bias against the oracle:
  1041 rows, a masked prefix per sequence."""
  _skip_without_hopper()
  problem = _biased_problem(rng, (3, 347), 320, 50257, layout, mask="prefix")
  kwargs = dict(kwargs, weight_layout=layout)
  check_against_oracle(problem, "bfloat16", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout, options", DISTILL_OPTIONS, ids=str)
def test_gpu_distillation_with_biases_at_gpt2s_vocabulary(rng, layout, options):
  _skip_without_hopper()
  heads, labels = _distill_heads(rng, 50257, jnp.bfloat16, layout, n=1000)
  check_distillation(heads, labels, weight_layout=layout, **options)
