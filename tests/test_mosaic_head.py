"""``impl="mosaic"``: the head as Mosaic GPU kernels (Hopper).

On a Hopper GPU the three products run in ``mst_jax._gemm.mosaic.gemm`` where
their arrays are whole TMA tiles and in ``lax.dot_general`` otherwise, and
the cross-entropy in ``_kernels.mosaic.ce`` (Triton where it does not take
the logits); each
case checks the lowered step really calls the Mosaic kernel, then compares
loss and gradients with the float64 oracle. Elsewhere the option falls back
to XLA's GEMMs with one warning and computes what ``impl=None`` computes.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  ALL_OPTIONS,
  check_against_oracle,
  has_gpu,
  make_problem,
  value_and_grads,
)

import mst_jax
from mst_jax import _kernels
from mst_jax._gemm import matmul
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.xla import XlaChunkCE


def _lowered_text(problem, **kwargs) -> str:
  def loss(hidden, weight, bias):
    return jnp.sum(
      mst_jax.linear_cross_entropy(
        hidden, weight, problem.labels, bias, where=problem.where, **kwargs
      )
    )

  args = (problem.hidden, problem.weight, problem.bias)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).as_text()


@pytest.mark.skipif(
  mosaic_gemm.unavailable_reason() is None, reason="checks the fallback"
)
def test_falls_back_to_xla_gemms_with_one_warning(rng):
  problem = make_problem(rng, (37,), dim=64, vocab=1031, dtype="bfloat16")
  _kernels._warn_fallback.cache_clear()
  with pytest.warns(RuntimeWarning, match="XLA's GEMMs instead of Mosaic GPU's"):
    loss, grads = value_and_grads(
      mst_jax.linear_cross_entropy, problem, impl="mosaic", chunk_size=16
    )
  want_loss, want_grads = value_and_grads(
    mst_jax.linear_cross_entropy, problem, chunk_size=16
  )
  np.testing.assert_array_equal(loss, want_loss)
  for got, want in zip(grads, want_grads, strict=True):
    np.testing.assert_array_equal(got, want)
  assert "mosaic_gpu" not in _lowered_text(problem, impl="mosaic", chunk_size=16)


def test_the_flax_options_take_mosaic():
  options = mst_jax.HeadLossOptions(impl="mosaic", chunk_size=256)
  assert options.impl == "mosaic"


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(weight_layout="dv", grad_mode="recompute"),
    dict(vocab_block_size=8192),
    dict(accum_dtype=jnp.bfloat16, **ALL_OPTIONS),
    dict(log_probs=True),
    dict(logits_dtype=jnp.float32),
    dict(logits_dtype=jnp.float32, grad_mode="recompute"),
    dict(dtype=jnp.float16),  # float32 logits by default
  ],
  ids=str,
)
def test_the_gpu_program_lowers_for_cuda(as_if_on_hopper, kwargs):
  """impl="mosaic" lowers to Mosaic GEMMs and Mosaic cross-entropy kernels
  (the entropy's included), chunks of 256 rows of 1000, the statistics of
  16-bit logits in the logits GEMM's epilogue, of float32 ones in a kernel
  of their own; nothing on Triton."""
  n, d, v = 1000, 320, 32000
  layout = kwargs.pop("weight_layout", "vd")
  log_probs = kwargs.pop("log_probs", False)
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  h = jax.ShapeDtypeStruct((n, d), dtype)
  w = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), dtype)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)
  options = dict(impl="mosaic", chunk_size=256, weight_layout=layout, **kwargs)

  def loss(h, w, y):
    if log_probs:
      lp, entropy = mst_jax.linear_log_probs(h, w, y, return_entropy=True, **options)
      return jnp.sum(lp) + jnp.sum(entropy)
    return mst_jax.linear_cross_entropy(h, w, y, **options)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "mst_jax_mosaic_gemm" in text
  float32_logits = kwargs.get("logits_dtype") == jnp.float32 or dtype == jnp.float16
  # 16-bit logits: the statistics in the logits GEMM's epilogue.
  assert ("_rows_mosaic" in text) != float32_logits
  assert ("mst_ce_stats_mosaic" in text) == float32_logits
  assert "triton" not in text


@pytest.mark.parametrize("return_entropy", [False, True], ids=str)
def test_kept_logits_take_their_statistics_from_the_epilogue(
  as_if_on_hopper, return_entropy
):
  """Per-token outputs whose logits fit the budget as one group keep them for
  the backward (``Plan.keep_logits``); their statistics come from the logits
  GEMM's epilogue, with no statistics kernel reading the logits back."""
  h = jax.ShapeDtypeStruct((1000, 320), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((32000, 320), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1000,), jnp.int32)

  def loss(h, w, y):
    out = mst_jax.linear_log_probs(h, w, y, return_entropy=return_entropy)
    return sum(jnp.sum(x) for x in jax.tree.leaves(out))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  # The three products and the dlogits kernel; no statistics kernel.
  assert "_rows_mosaic" in text
  assert text.count("custom_call @mosaic_gpu") == 4


@pytest.mark.parametrize(
  ("kwargs", "rows"), [(dict(), 1000), (dict(chunk_size=256), 256)], ids=str
)
def test_the_default_on_hopper_is_the_mosaic_program(as_if_on_hopper, kwargs, rows):
  """impl=None on a Hopper GPU lowers to the program impl="mosaic" does (the
  statistics in the logits GEMM's epilogue), not to XLA's GEMMs; "pallas"
  keeps XLA's GEMMs and the Triton kernels. By default the 1000 rows are one
  group; masked or not, it runs its products to a bound on its valid rows
  read on the device (``_sweep.rows.with_bound``): one logits GEMM, one
  ``dlogits`` kernel, one ``dhidden`` and one ``dweight`` GEMM in the whole
  step, whatever the memory budget's chunks."""
  h = jax.ShapeDtypeStruct((1000, 320), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((32000, 320), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1000,), jnp.int32)

  def text(**options):
    loss = lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **kwargs, **options)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()

  default = text()
  assert "_rows_mosaic" in default and "triton" not in default
  assert "stablehlo.dot_general" not in default
  logits = re.findall(r"mst_jax_mosaic_gemm_(\d+)x32000x320_bounded_m_rows\b", default)
  assert set(map(int, logits)) == {rows}
  assert default.count("custom_call @mosaic_gpu") == 4
  # The same kernels (jax 0.11 on serializes each Mosaic kernel with its
  # call site's locations, and numbers the kernels' names).
  names = lambda text: re.findall(r"mst_[a-z_0-9x]+", text)
  kernels = lambda text: sorted(re.sub(r"(_\d+)+$", "", n) for n in names(text))
  assert kernels(default) == kernels(text(impl="mosaic"))
  pallas = text(impl="pallas")
  assert "mosaic_gpu" not in pallas and "triton" in pallas


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(grad_mode="recompute", bias=True),
    dict(reduction="none", weight_layout="dv"),
    dict(chunk_size=128, label_smoothing=0.1, z_loss=1e-3),
    dict(grad_mode="fused", accum_dtype=jnp.bfloat16),
  ],
  ids=str,
)
def test_a_masked_group_runs_to_its_bound(rng, mosaic_on_cpu, monkeypatch, kwargs):
  """The Hopper program on the CPU, half of each sequence masked: each group
  or chunk runs its products to a bound past its last valid row (compacted
  first), read on the device. The stand-in GEMM writes NaN in the rows it
  may leave unspecified and never reads contracted rows past the bound, so
  the loss and gradients match the float64 oracle only if nothing reads past
  it unmasked. 180 rows count, past whole 64-row tiles of every block
  size, so some bound falls short of its block's rows."""
  bounds = []
  gemm = mosaic_gemm.matmul  # mosaic_on_cpu's stand-in

  def recorded(lhs, rhs, dims, *args, bound=None, bounded=None, **kw):
    if bound is not None:  # (bound, the rows it cuts)
      (lc,), _ = dims[0]
      rows = lhs.shape[lc if bounded == "k" else 1 - lc]
      jax.debug.callback(lambda b: bounds.append((int(b), rows)), bound)
    return gemm(lhs, rhs, dims, *args, bound=bound, bounded=bounded, **kw)

  monkeypatch.setattr(mosaic_gemm, "matmul", recorded)
  layout = kwargs.pop("weight_layout", "vd")
  bias = kwargs.pop("bias", False)
  problem = make_problem(
    rng,
    (2, 301),
    dim=64,
    vocab=4133,
    dtype="bfloat16",
    mask="none",
    bias=bias,
    weight_layout=layout,
  )
  # The first 211 tokens of each sequence masked (a prompt).
  problem = dataclasses.replace(problem, labels=problem.labels.at[:, :211].set(-100))
  check_against_oracle(
    problem, "bfloat16", impl="mosaic", weight_layout=layout, **kwargs
  )
  assert bounds and all(b % 64 == 0 or b == rows for b, rows in bounds)
  # Kept logits (per-token losses) stay in row order: the second sequence's
  # valid rows end at the last row.
  kept = kwargs.get("reduction") == "none"
  assert kept or any(b < rows for b, rows in bounds), bounds


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(grad_mode="recompute"),
    dict(grad_mode="fused", accum_dtype=jnp.bfloat16),
    dict(chunk_size=256, vocab_block_size=8192, **ALL_OPTIONS),
    dict(reduction="none"),
    dict(log_probs=True),
  ],
  ids=str,
)
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("vocab", [1001, 50257])
def test_a_ragged_vocabulary_lowers_to_mosaic_kernels_only(
  as_if_on_hopper, vocab, layout, kwargs
):
  """A vocabulary of 1001 or GPT-2's 50257 columns: the logits padded to
  whole 64-column tiles, every product and the cross-entropy on Mosaic GPU
  kernels, no Triton kernel and no XLA GEMM, in every loop order and with
  kept logits (per-token outputs). A ``[D, V]`` weight, whose rows TMA
  cannot copy, is transposed once per step (and its gradient back)."""
  n, d = 1000, 256
  kwargs = dict(kwargs, weight_layout=layout)
  log_probs = kwargs.pop("log_probs", False)
  h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((vocab, d) if layout == "vd" else (d, vocab), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)

  def loss(h, w, y):
    if log_probs:
      lp, entropy = mst_jax.linear_log_probs(
        h, w, y, return_entropy=True, weight_layout=layout
      )
      return jnp.sum(lp) + jnp.sum(entropy)
    return jnp.sum(mst_jax.linear_cross_entropy(h, w, y, **kwargs))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "_rows_mosaic" in text
  assert "custom_call @mosaic_gpu" in text
  assert "triton" not in text and "stablehlo.dot_general" not in text
  # Transposes: the weight's and its gradient's (none for a [V, D] weight).
  transposes = text.count("stablehlo.transpose")
  assert transposes == (0 if layout == "vd" else 2)


def test_a_weight_copy_comes_out_of_the_memory_budget(as_if_on_hopper, planned):
  """A ``[D, V]`` weight at V = 50257 is transposed where the copy and its
  gradient take at most half the memory budget, which then plans the rows
  with the rest; over half, it stays on XLA's GEMMs."""
  n, d, vocab = 4096, 512, 50257
  copies = 2 * d * vocab * 2
  h = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((d, vocab), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((n,), jnp.int32)

  def lowered(budget):
    planned.clear()
    options = dict(memory_budget=budget, weight_layout="dv", grad_mode="recompute")
    loss = lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, **options)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()

  assert "stablehlo.dot_general" in lowered(2 * copies - 1)
  assert planned == [("dv", 2 * copies - 1)]  # planned once a call
  transposed = lowered(3 * copies)
  assert "stablehlo.dot_general" not in transposed
  assert transposed.count("stablehlo.transpose") == 2
  assert planned == [("vd", 2 * copies)]


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(reduction="none", label_smoothing=0.1, z_loss=1e-3),
    dict(grad_mode="recompute", chunk_size=64),
    dict(chunk_size=64, vocab_block_size=300, z_loss=1e-3, grad_mode="recompute"),
  ],
  ids=str,
)
def test_a_transposed_weight_gives_the_given_ones_gradients(rng, monkeypatch, kwargs):
  """A ``[D, V]`` weight transposed for the backend (forced here on XLA's,
  which runs on any host): the loss, and ``dweight`` back in ``[D, V]``,
  against the float64 oracle."""
  transposed = []
  monkeypatch.setattr(
    XlaChunkCE,
    "transposes_weight",
    lambda self, x, head: transposed.append(x.weight.shape) or True,
  )
  problem = make_problem(rng, (3, 97), dim=48, vocab=1001, weight_layout="dv")
  check_against_oracle(problem, "float32", weight_layout="dv", impl="xla", **kwargs)
  assert transposed and transposed[0] == (48, 1001)


# float32 logits (of float16 inputs by default, or asked for) in whole groups
# of 4 chunks: 2048 rows and 128 MiB make 256-row chunks in 1024-row groups
# (at V=32000 and at GPT-2's 50257, whose logits, dlogits and the groups'
# buffers are padded to 50304 columns).
# float16 weights keep a float32 dweight accumulator (4 V D bytes), counted in
# the budget: 32 MiB more leaves the same groups.
WHOLE_GROUPS = [
  ("float16", 32000, dict(memory_budget=160 << 20)),
  ("bfloat16", 32000, dict(logits_dtype=jnp.float32)),
  ("float16", 50257, dict(reduction="sum", memory_budget=160 << 20)),
  ("bfloat16", 50257, dict(logits_dtype=jnp.float32, label_smoothing=0.1)),
]


@pytest.mark.parametrize("dtype, vocab, kwargs", WHOLE_GROUPS, ids=str)
def test_a_groups_buffer_is_written_by_mosaic_kernels(
  as_if_on_hopper, dtype, vocab, kwargs
):
  """Each chunk of a whole group writes its 16-bit ``dlogits`` of float32
  logits into the group's buffer with the Mosaic kernel, in place, at a row
  read from device memory: no Triton kernel, no XLA GEMM, and no
  dynamic_update_slice."""
  h = jax.ShapeDtypeStruct((2048, 320), dtype)
  w = jax.ShapeDtypeStruct((vocab, 320), dtype)
  y = jax.ShapeDtypeStruct((2048,), jnp.int32)
  options = {"impl": "mosaic", "memory_budget": 128 << 20, **kwargs}
  loss = lambda h, w, y: jnp.sum(mst_jax.linear_cross_entropy(h, w, y, **options))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  text = step.trace(h, w, y).lower(lowering_platforms=("cuda",)).as_text()
  assert "mst_ce_dlogits_mosaic" in text and "triton" not in text
  assert "stablehlo.dot_general" not in text
  width = matmul.padded_width(vocab)
  assert f"1024x{width}x{jnp.dtype(dtype).name[0]}" in text  # the group's buffer
  assert not re.search(rf"dynamic_update_slice[^\n]*x{width}x", text)  # no copy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vocab, kwargs", WHOLE_GROUPS, ids=str)
def test_gpu_whole_groups_of_float32_logits(rng, dtype, vocab, kwargs):
  """The same on the GPU against the float64 oracle: every token counts, so
  every group is whole."""
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)
  problem = make_problem(rng, (2, 1024), dim=320, vocab=vocab, dtype=dtype, mask="none")
  kwargs = {"impl": "mosaic", "memory_budget": 128 << 20, **kwargs}
  text = _lowered_text(problem, **kwargs)
  assert "triton" not in text and "stablehlo.dot_general" not in text
  width = matmul.padded_width(vocab)
  assert not re.search(rf"dynamic_update_slice[^\n]*x{width}x", text)
  check_against_oracle(problem, dtype, **kwargs)


def test_vmap_on_hopper_says_to_pass_pallas(as_if_on_hopper):
  """The Mosaic GPU kernels have no batching rule: under jax.vmap the default
  on a Hopper GPU raises a clear error; impl="pallas" lowers."""
  h = jax.ShapeDtypeStruct((2, 500, 320), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((32000, 320), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((2, 500), jnp.int32)

  def lower(**options):
    loss = lambda h, w, y: jnp.sum(mst_jax.linear_cross_entropy(h, w, y, **options))
    step = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(0, None, 0))
    return jax.jit(step).trace(h, w, y).lower(lowering_platforms=("cuda",))

  for options in (dict(), dict(grad_mode="recompute"), dict(reduction="none")):
    with pytest.raises(NotImplementedError, match="no batching rule.*impl='pallas'"):
      lower(**{"chunk_size": 256, **options})
  assert "triton" in lower(impl="pallas", chunk_size=256).as_text()


# (dtype, weight layout, V, options): TMA-aligned vocabularies, GPT-2's 50257
# (the logits padded to whole 64-column tiles; a [D, V] weight, whose rows of
# 50257 TMA cannot copy, transposed once per step),
# both gradient modes, the loss options, the bf16 accumulator, vocabulary
# blocks (the last one 1105 columns of 50257), per-token losses; chunks of
# 256 rows split dhidden's contraction (split-K).
CASES = [
  ("bfloat16", "vd", 32000, dict(chunk_size=256)),
  ("bfloat16", "dv", 32000, dict(chunk_size=256, grad_mode="recompute")),
  # float32 logits: 16-bit dlogits into a new array.
  ("bfloat16", "vd", 32000, dict(chunk_size=256, logits_dtype=jnp.float32)),
  # A sum: float16 dlogits of a mean over V=128256 would underflow to 0.
  ("float16", "vd", 128256, dict(chunk_size=512, reduction="sum", **ALL_OPTIONS)),
  ("bfloat16", "dv", 128256, dict(chunk_size=256, accum_dtype=jnp.bfloat16)),
  ("bfloat16", "vd", 128256, dict(chunk_size=512, vocab_block_size=8192)),
  ("bfloat16", "vd", 50257, dict(chunk_size=256, label_smoothing=0.1)),
  ("bfloat16", "vd", 50257, dict(grad_mode="recompute", **ALL_OPTIONS)),
  # float16 inputs: float32 logits by default (padded too), or float16.
  ("float16", "vd", 50257, dict(reduction="none", **ALL_OPTIONS)),
  ("float16", "vd", 50257, dict(reduction="sum", logits_dtype=jnp.float16)),
  ("float16", "dv", 50257, dict(reduction="sum", chunk_size=256, z_loss=1e-3)),
  # float16 logits of bfloat16 inputs: bfloat16 dlogits into a new array.
  ("bfloat16", "vd", 50257, dict(logits_dtype=jnp.float16, grad_mode="recompute")),
  ("bfloat16", "vd", 50257, dict(chunk_size=512, vocab_block_size=8192)),
  ("bfloat16", "vd", 50257, dict(accum_dtype=jnp.bfloat16, grad_mode="fused")),
  ("bfloat16", "dv", 50257, dict(chunk_size=256)),
  ("bfloat16", "dv", 50257, dict(reduction="none", **ALL_OPTIONS)),
  ("bfloat16", "dv", 50257, dict(grad_mode="fused", z_loss=1e-3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, layout, vocab, kwargs", CASES, ids=str)
def test_mosaic_matches_the_oracle(rng, dtype, layout, vocab, kwargs):
  assert has_gpu()
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)
  # 1041 rows: a masked prefix per sequence (skipped chunks) and a tail.
  problem = make_problem(
    rng,
    (3, 347),
    dim=320,
    vocab=vocab,
    dtype=dtype,
    weight_layout=layout,
    mask="prefix",
    bias=False,
  )
  kwargs = dict(kwargs, impl="mosaic", weight_layout=layout)
  text = _lowered_text(problem, **kwargs)
  assert "mosaic_gpu" in text and "triton" not in text
  assert "stablehlo.dot_general" not in text
  check_against_oracle(problem, dtype, **kwargs)


# bfloat16 heads with bfloat16 logits: each logit rounds by up to 2^-9 of
# itself, a fraction of a percent of the loss and of the gradients. float16
# heads: float32 logits, float16 dlogits (a sum: a mean's would underflow),
# 3e-4 of the gradients on XLA's chunk on a CPU.
DISTILL_RTOL = {
  "bfloat16": {"loss": 1e-2, "grads": 3e-2},
  "float16": {"loss": 1e-4, "grads": 2e-3},
}


@pytest.mark.gpu
@pytest.mark.parametrize(
  "vocab, options",
  [
    (32000, {}),
    (50257, {}),
    (50257, dict(divergence="jsd", hard_label_weight=0.3)),
    (50257, dict(weight_layout="dv", divergence="reverse_kl")),
    # float16 heads: float32 logits, float16 dlogits into a new array.
    (50257, dict(dtype=jnp.float16, divergence="jsd", hard_label_weight=0.3)),
    (32000, dict(dtype=jnp.float16, weight_layout="dv")),
  ],
  ids=str,
)
def test_mosaic_distillation_matches_the_oracle(rng, vocab, options):
  """Also at GPT-2's vocabulary, whose logits the GEMM pads to whole
  64-column tiles (``[D, V]`` weights transposed first), and for float16
  heads."""
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)
  options = dict(options)
  dtype = options.pop("dtype", jnp.bfloat16)
  n, d_s, d_t = 1000, 256, 512
  teacher = rng.standard_normal((n, d_t))
  student = teacher @ rng.standard_normal((d_t, d_s)) / np.sqrt(d_t)
  w_s = rng.standard_normal((vocab, d_s)) * 3 / np.sqrt(d_s)
  w_t = rng.standard_normal((vocab, d_t)) * 3 / np.sqrt(d_t)
  if options.get("weight_layout") == "dv":
    w_s, w_t = w_s.T, w_t.T
  arrays = [jnp.asarray(x, dtype) for x in (student, w_s, teacher, w_t)]
  labels = jnp.asarray(rng.integers(0, vocab, n), jnp.int32)
  options = dict(options, temperature=2.0)
  if dtype == jnp.float16:
    options["reduction"] = "sum"

  def value_and_grad(fn, h, w, t, wt, **kwargs):
    loss = lambda h, w, t, wt: fn(h, w, t, wt, labels, **options, **kwargs)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, t, wt)

  lowered = value_and_grad(
    mst_jax.linear_distillation_loss, *arrays, impl="mosaic", chunk_size=256
  )
  assert "mosaic_gpu" in lowered.as_text() and "triton" not in lowered.as_text()
  loss, grads = lowered.compile()(*arrays)
  with jax.enable_x64(True):
    arrays64 = [jnp.asarray(np.asarray(x, np.float64)) for x in arrays]
    ref_loss, ref_grads = value_and_grad(
      mst_jax.reference.linear_distillation_loss, *arrays64
    ).compile()(*arrays64)
    ref_loss = float(ref_loss)  # outside x64, jnp would truncate it to float32
  rtol = DISTILL_RTOL[jnp.dtype(dtype).name]
  assert abs(float(loss) - float(ref_loss)) <= rtol["loss"] * abs(ref_loss)
  for got, ref in zip(grads, ref_grads, strict=True):
    got, ref = np.asarray(got, np.float64), np.asarray(ref)
    assert np.linalg.norm(got - ref) <= rtol["grads"] * np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dim,vocab", [(64, 4160), (128, 64)])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_a_64_wide_head(rng, layout, dim, vocab):
  """D = 64 or V = 64 (outputs one swizzle span wide: ``[N, 64]``
  ``dhidden``, ``[V, 64]`` ``dweight``; ``[N, 64]`` logits with their
  statistics in the GEMM's epilogue) on the Mosaic GEMM, against the
  oracle."""
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)
  problem = make_problem(
    rng, (1000,), dim=dim, vocab=vocab, dtype="bfloat16", weight_layout=layout
  )
  check_against_oracle(problem, "bfloat16", impl="mosaic", weight_layout=layout)
