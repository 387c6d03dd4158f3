"""The Mosaic GPU distillation kernels (``_kernels.mosaic.distill``) against
the float64 oracle: in interpret mode on any host (the kernel bodies: both
heads' online statistics over tiles and vocabulary parts, the JSD's second
pass, ``dlogits``), lowered for a Hopper GPU on any host (what the default
step runs), and compiled on a Hopper GPU at real sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, to64
from test_distillation import (
  KERNEL_OPTIONS,
  kernel_options,
  kernel_oracle,
  kernel_rtol,
)

import mst_jax
from mst_jax import _kernels as backends
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.mosaic.ce import MosaicBlocks
from mst_jax._kernels.mosaic.distill import MosaicDistill, takes
from mst_jax._kernels.triton import distill as triton_distill
from mst_jax._kernels.triton.common import KernelBlocks
from mst_jax._kernels.xla import XlaDistill
from mst_jax._math import distill as distill_math

# 64 x 128 tiles: 200 rows are 4 row blocks (the last ragged), 1216 columns
# 10 tiles (the last ragged); 12 programs cut them into 3 parts of 4 tiles
# (merged as 4, one empty).
ROWS, VOCAB = 200, 1216
INTERPRET = MosaicDistill(tiles=MosaicBlocks(block_v=128, programs=12), interpret=True)


def _heads(rng, dtype=jnp.bfloat16, rows=ROWS, vocab=VOCAB):
  """Related bfloat16 heads with banned (-inf) columns, excluded rows, a label
  in the ragged last tile; the oracle reads the rounded values."""
  student = rng.standard_normal((rows, vocab)) * 3.0
  teacher = student + rng.standard_normal((rows, vocab)) * 2.0
  banned = rng.choice(vocab - 1, 5, replace=False)
  student[:, banned] = teacher[:, banned] = -np.inf
  labels = rng.choice(np.setdiff1d(np.arange(vocab), banned), rows)
  labels[0] = vocab - 1
  valid = rng.random(rows) > 0.2
  g_loss = rng.standard_normal(rows)
  heads = [jnp.asarray(x, dtype) for x in (student, teacher)]
  return heads, jnp.asarray(labels, jnp.int32), jnp.asarray(valid), g_loss


@pytest.mark.parametrize(
  "options", KERNEL_OPTIONS, ids=lambda o: "-".join(map(str, o.values()))
)
def test_kernels_match_the_oracle(rng, options):
  """Per-row losses and bfloat16 dlogits (written over the student's logits)
  against the float64 full-logits reference and its autodiff gradient."""
  heads, labels, valid, g_loss = _heads(rng)
  assert takes(*heads, jnp.bfloat16)
  opts = kernel_options(options)
  loss, dlogits = INTERPRET.chunk_loss(
    *heads, labels, valid, jnp.asarray(g_loss, jnp.float32), opts, jnp.bfloat16
  )
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  assert dlogits.dtype == jnp.bfloat16
  rtol = kernel_rtol(heads[0], options)
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(ROWS))
  assert_close(dlogits, ref_grad, rtol + 2.0**-8, "dlogits", atol=1e-7)
  assert np.all(to64(dlogits)[~np.asarray(valid)] == 0.0)
  loss_only, none = INTERPRET.chunk_loss(*heads, labels, valid, None, opts, None)
  assert none is None
  np.testing.assert_array_equal(np.asarray(loss_only), np.asarray(loss))


TRITON = triton_distill.PallasTritonDistill(
  blocks=KernelBlocks(block_rows=32, block_v=512), interpret=True
)


@pytest.mark.parametrize(
  "logits_dtype, teacher_dtype, out_dtype",
  [
    (jnp.float32, jnp.float32, jnp.bfloat16),
    (jnp.float32, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),  # a float32 teacher
    (jnp.float32, jnp.float16, jnp.float32),
  ],
  ids=str,
)
def test_other_logits_and_dlogits_dtypes(rng, logits_dtype, teacher_dtype, out_dtype):
  """float32 heads (float16 inputs' default logits), heads of two dtypes,
  ``dlogits`` of another dtype than the logits' (into a new array): on the
  kernels, against the float64 oracle (of the rounded heads)."""
  heads, labels, valid, g_loss = _heads(rng, logits_dtype)
  heads[1] = heads[1].astype(teacher_dtype)
  assert takes(*heads, out_dtype)
  opts = kernel_options(KERNEL_OPTIONS[1])
  g = jnp.asarray(g_loss, jnp.float32)
  never = lambda: pytest.fail("the fallback was asked for")
  kernel = dataclasses.replace(INTERPRET, fallback=never)
  loss, dlogits = kernel.chunk_loss(*heads, labels, valid, g, opts, out_dtype)
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  assert dlogits.dtype == out_dtype and dlogits.shape == heads[0].shape
  rtol = kernel_rtol(heads[0], KERNEL_OPTIONS[1])
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(ROWS))
  rtol += 2.0**-8 if out_dtype == jnp.bfloat16 else 0.0
  assert_close(dlogits, ref_grad, rtol, "dlogits", atol=1e-7)


@pytest.mark.parametrize(
  "case, fallback",
  [
    ("unaligned_vocab", None),
    ("unaligned_rows", None),
    ("float32_unaligned", None),
    ("two_dtypes_unaligned", None),
    ("two_dtypes_unaligned", TRITON),
    ("unaligned_vocab", TRITON),
  ],
  ids=lambda x: "triton" if x is TRITON else ("xla" if x is None else x),
)
def test_what_the_kernels_do_not_take_goes_to_the_fallback(rng, case, fallback):
  """Other logits go to the fallback (XLA's chunk or the Triton kernel),
  whose results the kernel returns."""
  vocab = VOCAB - 3 if "unaligned" in case else VOCAB
  rows = ROWS - 3 if case == "unaligned_rows" else ROWS
  dtype = jnp.float32 if case == "float32_unaligned" else jnp.bfloat16
  heads, labels, valid, g_loss = _heads(rng, dtype, rows, vocab)
  if case == "two_dtypes_unaligned":
    heads[1] = heads[1].astype(jnp.float32)
  out_dtype = dtype
  assert not takes(*heads, out_dtype)
  opts = kernel_options(KERNEL_OPTIONS[1])
  g = jnp.asarray(g_loss, jnp.float32)
  kernel = dataclasses.replace(INTERPRET, fallback=lambda: fallback or XlaDistill())
  loss, dlogits = kernel.chunk_loss(*heads, labels, valid, g, opts, out_dtype)
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  assert dlogits.dtype == out_dtype
  assert_close(loss, ref_loss, 1e-5, "loss", atol=1e-5 * np.sqrt(rows))
  rtol = 1e-5 if out_dtype == jnp.float32 else 2.0**-8
  assert_close(dlogits, ref_grad, rtol, "dlogits", atol=1e-7)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("options", [KERNEL_OPTIONS[1], KERNEL_OPTIONS[5]], ids=str)
def test_logits_padded_past_the_weights_columns(rng, options, out_dtype):
  """Heads of 1213 columns padded with zeros to 1216 (what the Mosaic GEMM
  forms for a vocabulary that is not whole 64-column tiles), read against
  ``n_cols=1213``: the loss and dlogits of the 1213 columns, zeros past
  them; in place, or (float32 dlogits) into a new array."""
  n_cols = VOCAB - 3
  heads, labels, valid, g_loss = _heads(rng, vocab=n_cols)
  padded = [jnp.pad(x, ((0, 0), (0, VOCAB - n_cols))) for x in heads]
  assert takes(*padded, out_dtype) and not takes(*heads, out_dtype)
  opts = kernel_options(options)
  g = jnp.asarray(g_loss, jnp.float32)
  loss, dlogits = INTERPRET.chunk_loss(
    *padded, labels, valid, g, opts, out_dtype, n_cols=n_cols
  )
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  assert dlogits.shape == (ROWS, VOCAB) and dlogits.dtype == out_dtype
  rtol = kernel_rtol(heads[0], options)
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(ROWS))
  assert_close(dlogits[:, :n_cols], ref_grad, rtol + 2.0**-8, "dlogits", atol=1e-7)
  assert np.all(to64(dlogits[:, n_cols:]) == 0.0)


@pytest.mark.parametrize("programs", [4, 8, 40], ids=["1part", "2parts", "10parts"])
def test_any_number_of_vocabulary_parts(rng, programs):
  """One part, a power of 2, and 10 (merged as 16): the JSD's two passes and
  the hard-label term against the oracle."""
  heads, labels, valid, g_loss = _heads(rng)
  options = KERNEL_OPTIONS[5]
  kernel = MosaicDistill(tiles=MosaicBlocks(block_v=128, programs=programs))
  kernel = dataclasses.replace(kernel, interpret=True)
  g = jnp.asarray(g_loss, jnp.float32)
  opts = kernel_options(options)
  loss, dlogits = kernel.chunk_loss(*heads, labels, valid, g, opts, jnp.bfloat16)
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  rtol = kernel_rtol(heads[0], options)
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(ROWS))
  assert_close(dlogits, ref_grad, rtol + 2.0**-8, "dlogits", atol=1e-7)


def test_a_label_outside_the_vocabulary_is_nan_as_in_xla(rng):
  """With the hard-label term, a valid row whose label is outside [0, V) has
  a NaN loss and NaN dlogits, as XLA's chunk gives; other rows are finite."""
  heads, labels, valid, g_loss = _heads(rng)
  labels = labels.at[3].set(VOCAB + 5).at[4].set(-7)
  valid = valid.at[3].set(True).at[4].set(True)
  opts = kernel_options(KERNEL_OPTIONS[3])
  g = jnp.asarray(g_loss, jnp.float32)
  loss, dlogits = INTERPRET.chunk_loss(*heads, labels, valid, g, opts, jnp.bfloat16)
  ref_loss, ref_grad = distill_math.chunk_loss(*heads, labels, valid, g, opts)
  bad = np.isin(np.arange(ROWS), [3, 4])
  assert np.isnan(to64(loss)[bad]).all() and np.isnan(to64(ref_loss)[bad]).all()
  assert np.isnan(to64(dlogits)[bad]).any(axis=1).all()
  assert_close(to64(loss)[~bad], to64(ref_loss)[~bad], 1e-5, "loss", atol=1e-5)
  assert_close(to64(dlogits)[~bad], to64(ref_grad)[~bad], 2.0**-8, "dlogits")


def test_a_label_in_or_past_the_padding_is_nan_as_in_xla(rng):
  """Logits padded past 1213 columns: labels in the padding (1213, 1215), past
  it and negative give NaN rows as XLA's chunk of the 1213 columns does; the
  padding's dlogits stay zero."""
  n_cols = VOCAB - 3
  heads, labels, valid, g_loss = _heads(rng, vocab=n_cols)
  padded = [jnp.pad(x, ((0, 0), (0, VOCAB - n_cols))) for x in heads]
  bad_rows, bad_labels = [3, 4, 5, 6], [n_cols, VOCAB - 1, VOCAB + 5, -7]
  for row, label in zip(bad_rows, bad_labels, strict=True):
    labels, valid = labels.at[row].set(label), valid.at[row].set(True)
  opts = kernel_options(KERNEL_OPTIONS[3])
  g = jnp.asarray(g_loss, jnp.float32)
  loss, dlogits = INTERPRET.chunk_loss(
    *padded, labels, valid, g, opts, jnp.bfloat16, n_cols=n_cols
  )
  ref_loss, ref_grad = distill_math.chunk_loss(*heads, labels, valid, g, opts)
  bad = np.isin(np.arange(ROWS), bad_rows)
  assert np.isnan(to64(loss)[bad]).all() and np.isnan(to64(ref_loss)[bad]).all()
  assert np.isnan(to64(dlogits)[bad, :n_cols]).any(axis=1).all()
  assert np.all(to64(dlogits[:, n_cols:]) == 0.0)
  assert_close(to64(loss)[~bad], to64(ref_loss)[~bad], 1e-5, "loss", atol=1e-5)
  got = to64(dlogits)[~bad, :n_cols]
  assert_close(got, to64(ref_grad)[~bad], 2.0**-8, "dlogits")


def test_in_place_where_the_kernels_or_the_fallback_are():
  """The Mosaic kernels and the Triton kernel write dlogits over the
  logits; XLA's chunk never does, so the planner must not count on it for
  heads the Mosaic kernels do not take (an unaligned width). Heads they
  take, of one dtype or two, never ask for the fallback (choosing one
  compiles a Triton kernel)."""
  head = lambda vocab, dtype=jnp.bfloat16: jax.ShapeDtypeStruct((ROWS, vocab), dtype)
  bf16 = jnp.bfloat16
  triton = MosaicDistill(fallback=lambda: triton_distill.PallasTritonDistill())
  assert triton.in_place(head(VOCAB - 3), head(VOCAB - 3), bf16)
  assert triton.in_place(head(VOCAB), head(VOCAB, jnp.float32), bf16)
  assert not triton.in_place(head(VOCAB), head(VOCAB), jnp.float32)
  xla = MosaicDistill()
  assert not xla.in_place(head(VOCAB - 3), head(VOCAB - 3), bf16)
  assert not xla.in_place(head(VOCAB - 32), head(VOCAB - 32, jnp.float32), bf16)

  def never():
    raise AssertionError("the fallback was asked for")

  mosaic = MosaicDistill(fallback=never)
  assert mosaic.in_place(head(VOCAB), head(VOCAB), bf16)
  assert mosaic.in_place(head(VOCAB), head(VOCAB, jnp.float32), bf16)


def test_selection_on_hopper(monkeypatch):
  """impl=None and "mosaic": the Mosaic kernels with XLA's chunk behind them;
  "pallas" and "xla" as asked; another GPU: the Triton kernel; a CPU: XLA's
  chunk."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(backends, "pallas_unavailable_reason", lambda platform: None)
  for impl in (None, "mosaic"):
    chosen = backends.select_distill(impl, "gpu")
    assert isinstance(chosen, MosaicDistill) and not chosen.interpret
    assert isinstance(chosen.fallback(), backends.XlaDistill)
  chosen = backends.select_distill("pallas", "gpu")
  assert isinstance(chosen, triton_distill.PallasTritonDistill)
  assert isinstance(backends.select_distill("xla", "gpu"), backends.XlaDistill)
  assert isinstance(backends.select_distill(None, "cpu"), backends.XlaDistill)
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: "compute 8.0")
  chosen = backends.select_distill(None, "gpu")
  assert isinstance(chosen, triton_distill.PallasTritonDistill)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("vocab", [32000, 50257])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_the_default_on_hopper_runs_the_mosaic_kernels(
  as_if_on_hopper, monkeypatch, divergence, vocab, layout, dtype
):
  """impl=None on a Hopper GPU lowers a distillation step to Mosaic GPU
  kernels only (no Triton, no XLA GEMM): the GEMMs, the statistics pass (and
  the JSD's second, here with the hard-label term), and dlogits, also at
  GPT-2's vocabulary (logits padded to whole 64-column tiles; ``[D, V]``
  weights, whose rows of 50257 TMA cannot copy, transposed once per step),
  and for float16 heads (float32 logits); impl="pallas" keeps the Triton
  kernel."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  shape = lambda d: (vocab, d) if layout == "vd" else (d, vocab)
  h_s = jax.ShapeDtypeStruct((1000, 256), dtype)
  w_s = jax.ShapeDtypeStruct(shape(256), dtype)
  h_t = jax.ShapeDtypeStruct((1000, 320), dtype)
  w_t = jax.ShapeDtypeStruct(shape(320), dtype)
  labels = jax.ShapeDtypeStruct((1000,), jnp.int32)
  hard = 0.5 if divergence == "jsd" else 0.0

  def text(**options):
    loss = lambda *heads: mst_jax.linear_distillation_loss(
      *heads,
      divergence=divergence,
      hard_label_weight=hard,
      weight_layout=layout,
      **options,
    )
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    lowered = step.trace(h_s, w_s, h_t, w_t, labels).lower(lowering_platforms=("cuda",))
    return lowered.as_text()

  default = text()
  assert "triton" not in default and "stablehlo.dot_general" not in default
  # Two logits GEMMs, dhidden, dweight; the statistics, the JSD's sums, dlogits.
  kernels = 4 + 2 + (divergence == "jsd")
  assert default.count("custom_call @mosaic_gpu") == kernels
  # Transposes: both weights and the student's gradient, where TMA cannot
  # copy a [D, V] weight's rows.
  transposes = 3 if layout == "dv" and vocab % 64 else 0
  assert default.count("stablehlo.transpose") == transposes
  pallas = text(impl="pallas")
  assert "mosaic_gpu" not in pallas and "triton" in pallas


@pytest.mark.parametrize("vocab", [32000, 50257])
def test_heads_of_two_dtypes_run_the_mosaic_kernels(
  as_if_on_hopper, monkeypatch, vocab
):
  """A bfloat16 student (bfloat16 logits) and a float16 teacher (float32
  logits) lower to Mosaic GPU kernels only, padded at GPT-2's vocabulary as
  well."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  h_s = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16)
  w_s = jax.ShapeDtypeStruct((vocab, 256), jnp.bfloat16)
  h_t = jax.ShapeDtypeStruct((1000, 320), jnp.float16)
  w_t = jax.ShapeDtypeStruct((vocab, 320), jnp.float16)
  labels = jax.ShapeDtypeStruct((1000,), jnp.int32)
  loss = lambda *heads: mst_jax.linear_distillation_loss(*heads, divergence="jsd")
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  lowered = step.trace(h_s, w_s, h_t, w_t, labels).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "triton" not in text and "stablehlo.dot_general" not in text
  # Two logits GEMMs, dhidden, dweight; the statistics, the JSD's sums, dlogits.
  assert text.count("custom_call @mosaic_gpu") == 7


@pytest.mark.gpu
@pytest.mark.parametrize(
  "options", KERNEL_OPTIONS, ids=lambda o: "-".join(map(str, o.values()))
)
def test_gpu_kernels_match_the_oracle(rng, options):
  """The compiled kernels (TMA pipelines, approximate exp, in-place writes)
  at a real vocabulary, ragged row blocks and the default tiles."""
  heads, labels, valid, g_loss = _heads(rng, rows=1000, vocab=32000)
  opts = kernel_options(options)
  kernel = MosaicDistill()
  g = jnp.asarray(g_loss, jnp.float32)
  loss, dlogits = jax.jit(kernel.chunk_loss, static_argnums=(5, 6))(
    *heads, labels, valid, g, opts, jnp.bfloat16
  )
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  rtol = kernel_rtol(heads[0], options, base=1e-4)  # ex2.approx: a few ulps
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(1000))
  assert_close(dlogits, ref_grad, rtol + 2.0**-8, "dlogits", atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("student", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("options", [KERNEL_OPTIONS[1], KERNEL_OPTIONS[5]], ids=str)
def test_gpu_float32_heads(rng, options, student):
  """float32 heads (float16 inputs' default logits, twice the shared memory
  per tile) with bfloat16 ``dlogits`` (into a new array), and a bfloat16
  student beside a float32 teacher (in place), compiled at a real
  vocabulary."""
  heads, labels, valid, g_loss = _heads(rng, jnp.float32, rows=1000, vocab=32000)
  heads[0] = heads[0].astype(student)
  opts = kernel_options(options)
  g = jnp.asarray(g_loss, jnp.float32)
  loss, dlogits = jax.jit(MosaicDistill().chunk_loss, static_argnums=(5, 6))(
    *heads, labels, valid, g, opts, jnp.bfloat16
  )
  ref_loss, ref_grad = kernel_oracle(heads, labels, valid, g_loss, opts)
  rtol = kernel_rtol(heads[0], options, base=1e-4)  # ex2.approx: a few ulps
  assert dlogits.dtype == jnp.bfloat16
  assert_close(loss, ref_loss, rtol, "loss", atol=rtol * np.sqrt(1000))
  assert_close(dlogits, ref_grad, rtol + 2.0**-8, "dlogits", atol=1e-7)
