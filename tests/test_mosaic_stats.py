"""The cross-entropy's statistics in the Mosaic logits GEMM's epilogue
(``_kernels.mosaic.stats.TileStats``) against the float64 oracle: the tile
math on any host (the epilogue's calls replayed tile by tile in plain JAX),
the kernel's Python lowering on any host, the compiled kernel on a Hopper GPU
at real sizes (ragged row and column tiles, both weight layouts).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_OPTIONS as LOSS_OPTIONS
from conftest import assert_close, check_against_oracle, has_gpu, make_problem
from test_backends import (
  ALL_OPTIONS,
  PLAIN,
  SCALED,
  _label_tied_for_max,
  _logits_case,
  _oracle,
)

from mst_jax import reference
from mst_jax._gemm import matmul
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._gemm.mosaic.kernels import gemm
from mst_jax._kernels import base
from mst_jax._kernels.mosaic import stats as mosaic_stats
from mst_jax._kernels.mosaic.ce import MosaicChunkCE
from mst_jax._math import ce as ce_math

ENTROPY = ce_math.CEOptions(label_smoothing=0.1, entropy=True)
OPTIONS = {"plain": PLAIN, "all": ALL_OPTIONS, "scaled": SCALED, "entropy": ENTROPY}


def _replay(logits, labels, options, tile_m, tile_n):
  """``TileStats``' outputs as the kernel writes them (``[parts, rows]``),
  computed tile by tile in plain JAX; past the logits' ends the tiles hold
  garbage (the kernel's zero rows and columns must count for nothing)."""
  n_rows, n_cols = logits.shape
  rows_pad, cols_pad = -n_rows % tile_m, -n_cols % tile_n
  padded = jnp.pad(logits, ((0, rows_pad), (0, cols_pad)), constant_values=1e4)
  labels = jnp.pad(labels, (0, rows_pad))
  epilogue = mosaic_stats.TileStats(options, n_cols)
  parts = []
  for j in range(0, n_cols + cols_pad, tile_n):
    blocks = [
      epilogue(padded[i : i + tile_m, j : j + tile_n], j, [labels[i : i + tile_m]])
      for i in range(0, n_rows + rows_pad, tile_m)
    ]
    parts.append([jnp.concatenate(values) for values in zip(*blocks, strict=True)])
  outputs = [jnp.stack(part)[:, :n_rows] for part in zip(*parts, strict=True)]
  assert [o.dtype for o in outputs] == list(epilogue.out_dtypes)
  return outputs


def _check_stats(stats, logits, labels, valid, options):
  """``stats`` (of the 16-bit ``logits``) against the float64 oracle."""
  vocab = logits.shape[1]
  g = jnp.ones(logits.shape[0], jnp.float32)
  (ref_loss, ref_lse, ref_correct), _ = _oracle(
    logits, labels, valid, g, jnp.zeros_like(g), options
  )
  loss, lse, correct, _ = ce_math.row_outputs(stats, labels, valid, options, vocab)
  assert_close(loss, ref_loss, 1e-6, "loss")
  assert_close(lse, ref_lse, 1e-6, "lse")
  tied = _label_tied_for_max(logits, labels, valid, options)
  np.testing.assert_array_equal(np.asarray(correct)[~tied], ref_correct[~tied])
  if options.logit_softcap is None:  # a softcap saturates large logits to ties
    np.testing.assert_array_equal(stats.argmax, np.argmax(np.asarray(logits), axis=-1))
  if options.entropy:
    with jax.enable_x64(True):
      x64 = jnp.asarray(np.asarray(logits, np.float64))
      *_, ref_entropy = reference.losses_from_logits(
        x64, labels, valid, options=options
      )
    entropy = np.where(valid, stats.lse - stats.expected_score, 0.0)
    # lse - E[s] cancels: a few float32 ulps of the logits' magnitude a row.
    magnitude = float(np.max(np.abs(np.asarray(logits, np.float32))))
    ulps = 8 * magnitude * 2.0**-24 * np.sqrt(len(entropy))
    assert_close(entropy, ref_entropy, 1e-5, "entropy", atol=max(1e-5, ulps))


@pytest.mark.parametrize("case", ["normal", "label_in_tail", "very_negative", "large"])
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
def test_tile_statistics_match_the_oracle(rng, case, options):
  """200 rows in 2 row tiles of 128 (the last ragged), 1000 columns in 6
  tiles of 192 (the last ragged, garbage past the end)."""
  logits, labels, valid = _logits_case(rng, case, 200, 1000)
  logits = logits.astype(jnp.bfloat16)
  outputs = _replay(logits, labels, options, tile_m=128, tile_n=192)
  widths = mosaic_stats.part_widths(1000, 192)
  stats = mosaic_stats.combine(outputs, widths, 1000, options)
  _check_stats(stats, logits, labels, valid, options)


def test_part_widths():
  np.testing.assert_array_equal(
    mosaic_stats.part_widths(1000, 192)[:, 0], [192] * 5 + [40]
  )
  np.testing.assert_array_equal(mosaic_stats.part_widths(384, 192)[:, 0], [192] * 2)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize(
  "options, out_dtype",
  [(PLAIN, "bfloat16"), (ENTROPY, "bfloat16"), (ALL_OPTIONS, "float16")],
  ids=["plain", "entropy", "all-float16"],
)
def test_the_fused_gemm_lowers_for_hopper(layout, options, out_dtype):
  """The logits GEMM with the statistics in its epilogue lowers to one
  Mosaic GPU kernel (Python passes only; no GPU), ping-pong and unsplit."""
  n, d, v = 1000, 320, 32000
  lhs = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((v, d) if layout == "vd" else (d, v), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((n,), jnp.int32)
  dims = matmul._LOGITS_DIMS[layout]
  epilogue = mosaic_stats.TileStats(options, v)
  problem = mosaic_gemm._check(lhs, rhs, dims, out_dtype, None)
  config = mosaic_gemm._config(problem, epilogue)
  assert config.split == "tiles" and config.k_splits == 1

  def fused(a, b, y):
    return gemm(a, b, None, problem, config, 132, rows=(epilogue, [y]))

  text = jax.jit(fused).trace(lhs, rhs, labels).lower(lowering_platforms=("cuda",))
  assert "mst_jax_mosaic_gemm_1000x32000x320_rows" in text.as_text()


def test_row_epilogues_take_unsplit_ping_pong_products_only():
  problem = mosaic_gemm._check(
    jnp.zeros((64, 64), jnp.bfloat16),
    jnp.zeros((64, 128), jnp.bfloat16),
    (((1,), (0,)), ((), ())),
    jnp.bfloat16,
    None,
  )
  rows = (mosaic_stats.TileStats(PLAIN, 128), [jnp.zeros(64, jnp.int32)])
  cooperative = mosaic_gemm.GemmConfig()
  with pytest.raises(ValueError, match="unsplit ping-pong"):
    gemm(None, None, None, problem, cooperative, 132, rows=rows)


def test_matmul_checks_the_row_inputs(monkeypatch):
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  a, b = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16)
  dims = matmul._LOGITS_DIMS["vd"]
  epilogue = mosaic_stats.TileStats(PLAIN, 128)
  with pytest.raises(ValueError, match=r"1 arrays of shape \(64,\), got \[\(63,\)\]"):
    mosaic_gemm.matmul(
      a, b, dims, row_epilogue=epilogue, row_inputs=(jnp.zeros(63, jnp.int32),)
    )
  with pytest.raises(ValueError, match="does not run with accumulate"):
    mosaic_gemm.matmul(
      a,
      b,
      dims,
      accumulate=jnp.zeros((64, 128), jnp.bfloat16),
      row_epilogue=epilogue,
      row_inputs=(jnp.zeros(64, jnp.int32),),
    )


def test_no_fusion_off_the_mosaic_gemm_with_a_bias_or_float32_logits(rng):
  """XLA's GEMMs, a bias or float32 logits: the GEMM gives the logits alone
  (statistics None: the cross-entropy kernels form them, as for the other
  backends)."""
  x = base.ChunkInputs(
    jnp.zeros((64, 64), jnp.bfloat16),
    jnp.zeros((128, 64), jnp.bfloat16),
    None,
    jnp.zeros(64, jnp.int32),
  )
  head = base.HeadSpec("vd", jnp.dtype(jnp.bfloat16), PLAIN, 128, gemm="xla")
  logits, stats = MosaicChunkCE().logits_and_stats(x, head, 0)
  assert logits.shape == (64, 128) and stats is None
  biased = x._replace(bias=jnp.zeros(128, jnp.bfloat16))
  head = dataclasses.replace(head, gemm="mosaic")
  assert MosaicChunkCE().logits_and_stats(biased, head, 0)[1] is None
  wide = dataclasses.replace(head, logits_dtype=jnp.dtype(jnp.float32))
  logits, stats = MosaicChunkCE().logits_and_stats(x, wide, 0)
  assert logits.dtype == jnp.float32 and stats is None


@pytest.mark.parametrize(
  "layout, kwargs",
  [
    ("vd", dict(grad_mode="recompute", **LOSS_OPTIONS)),
    ("dv", dict(grad_mode="fused", label_smoothing=0.1)),
    ("vd", dict(grad_mode="fused", chunk_size=64)),
  ],
  ids=str,
)
def test_the_hopper_step_takes_its_statistics_from_the_epilogue(
  rng, mosaic_on_cpu, monkeypatch, layout, kwargs
):
  """The Hopper program of a bfloat16 head on the CPU (``mosaic_on_cpu``:
  the epilogue run over each output tile of the rounded logits): its loss and
  gradients against the float64 oracle, the statistics from the epilogue."""
  calls = []
  tile_stats = mosaic_stats.TileStats.__call__
  monkeypatch.setattr(
    mosaic_stats.TileStats,
    "__call__",
    lambda self, *args: calls.append(1) or tile_stats(self, *args),
  )
  problem = make_problem(
    rng, (3, 101), dim=64, vocab=4133, dtype="bfloat16", weight_layout=layout
  )
  kwargs = dict(kwargs, impl="mosaic", weight_layout=layout)
  check_against_oracle(problem, "bfloat16", **kwargs)
  assert calls


# ---- On a Hopper GPU: the compiled kernel at real sizes. ----


@pytest.mark.gpu
@pytest.mark.parametrize(
  "n, d, v, layout, options",
  [
    (1000, 256, 4160, "vd", ALL_OPTIONS),
    (1000, 256, 4160, "dv", ENTROPY),
    (264, 320, 32000, "dv", SCALED),
    (1032, 2304, 256000, "vd", ENTROPY),
    # An operand past L2: the tiles walked along the columns first.
    (2056, 8192, 32000, "vd", PLAIN),
  ],
  ids=str,
)
def test_gpu_statistics_in_the_epilogue_match_the_oracle(rng, n, d, v, layout, options):
  """The fused GEMM's logits against the float64 product, its statistics
  against the float64 oracle of those logits and against the statistics
  kernel's; labels in the ragged last column tile, out-of-range labels. From
  jaxlib 0.12 on, the logits alone (the statistics come from their kernel)."""
  assert has_gpu()
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)
  hidden = rng.standard_normal((n, d)) / np.sqrt(d)
  weight = rng.standard_normal((v, d) if layout == "vd" else (d, v)) * 3
  labels = rng.integers(0, v, n)
  labels[: n // 4] = rng.integers(v - (v % 192 or 192), v, n // 4)
  labels[-3:] = [-100, v, v + 7]  # ignored rows, another shard's labels
  valid = jnp.asarray((labels >= 0) & (labels < v))
  x = base.ChunkInputs(
    jnp.asarray(hidden, jnp.bfloat16),
    jnp.asarray(weight, jnp.bfloat16),
    None,
    jnp.asarray(labels, jnp.int32),
  )
  head = base.HeadSpec(layout, jnp.dtype(jnp.bfloat16), options, v, gemm="mosaic")
  backend = MosaicChunkCE()
  logits, stats = jax.jit(lambda x: backend.logits_and_stats(x, head, 0))(x)
  with jax.enable_x64(True):
    h64, w64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x.hidden, x.weight))
    want = h64 @ (w64.T if layout == "vd" else w64)
  assert_close(logits, want, 2**-8, "logits")
  if not mosaic_gemm.fuses_row_epilogues():  # jaxlib 0.12 on: a statistics kernel
    assert stats is None
    return
  _check_stats(stats, logits, x.labels, valid, options)
  kernel = jax.jit(lambda y: backend.forward(y, x.labels, options))(logits)
  assert_close(stats.lse, np.asarray(kernel.lse, np.float64), 1e-6, "lse")
  np.testing.assert_array_equal(stats.argmax, kernel.argmax)
