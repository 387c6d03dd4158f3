"""The Mosaic GPU cross-entropy kernels (``_kernels.mosaic.ce``) against the
float64 oracle: in interpret mode on any host (the kernel bodies: online
statistics over tiles and vocabulary parts, ``dlogits``), compiled on a
Hopper GPU at real sizes (the TMA pipelines, in-place writes, ragged tiles).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, has_gpu
from test_backends import (
  ALL_OPTIONS,
  PLAIN,
  SCALED,
  _logits_case,
  _oracle,
  check_backend,
)

from mst_jax import _kernels as backends
from mst_jax import reference
from mst_jax._gemm import matmul
from mst_jax._gemm.mosaic import gemm as mosaic_gemm
from mst_jax._kernels.mosaic.ce import MosaicBlocks, MosaicChunkCE, takes
from mst_jax._kernels.triton import ce as triton_ce
from mst_jax._math import ce as ce_math

# 64 x 128 tiles, 8 programs: 200 rows are 4 row blocks (the last ragged), 1216
# columns 10 tiles (the last ragged) in 2 parts of 5.
INTERPRET = MosaicChunkCE(tiles=MosaicBlocks(block_v=128, programs=8), interpret=True)


def _bf16_case(rng, case, n_rows, vocab):
  logits, labels, valid = _logits_case(rng, case, n_rows, vocab)
  return logits.astype(jnp.bfloat16), labels, valid  # the oracle reads these


@pytest.mark.parametrize(
  "case", ["normal", "label_in_tail", "very_negative", "large", "all_excluded"]
)
@pytest.mark.parametrize(
  "options", [PLAIN, ALL_OPTIONS, SCALED], ids=["plain", "all", "scaled"]
)
def test_kernels_match_the_oracle(rng, case, options):
  logits, labels, valid = _bf16_case(rng, case, 200, 1216)
  assert takes(logits)
  check_backend(INTERPRET, logits, labels, valid, options, rng, jnp.bfloat16)


def test_banned_columns_and_rows(rng):
  """-inf logits: a banned column in every row, a row with every column
  banned (lse -inf, no mass), a banned label (loss +inf)."""
  logits, labels, valid = _bf16_case(rng, "normal", 64, 640)
  logits = logits.at[:, 7].set(-jnp.inf).at[3].set(-jnp.inf)
  labels = labels.at[5].set(7)
  stats = INTERPRET.forward(logits, labels, PLAIN)
  with jax.enable_x64(True):
    x = jnp.asarray(np.asarray(logits, np.float64))
    ref_lse = jax.nn.logsumexp(x, axis=-1)
  assert np.asarray(stats.lse)[3] == -np.inf
  keep = np.arange(64) != 3
  assert_close(np.asarray(stats.lse)[keep], np.asarray(ref_lse)[keep], 1e-6, "lse")
  assert np.asarray(stats.target)[5] == -np.inf
  np.testing.assert_array_equal(
    np.asarray(stats.argmax)[keep], np.argmax(np.asarray(x), axis=-1)[keep]
  )


def test_entropy_matches_the_oracle(rng):
  """``linear_log_probs``' statistics and ``dlogits`` with an entropy cotangent."""
  options = ce_math.CEOptions(entropy=True)
  logits, labels, valid = _bf16_case(rng, "normal", 200, 1216)
  n_rows, vocab = logits.shape
  g_loss, g_ent = (jnp.asarray(rng.standard_normal(n_rows), jnp.float32) for _ in "ab")
  with jax.enable_x64(True):
    x64 = jnp.asarray(np.asarray(logits, np.float64))
    g64 = [jnp.asarray(np.asarray(g, np.float64)) for g in (g_loss, g_ent)]

    def total(x):
      loss, _, _, entropy = reference.losses_from_logits(
        x, labels, valid, options=options
      )
      return jnp.sum(g64[0] * loss + g64[1] * entropy)

    _, _, _, ref_entropy = reference.losses_from_logits(
      x64, labels, valid, options=options
    )
    ref_dlogits = jax.grad(total)(x64)
  stats = INTERPRET.forward(logits, labels, options)
  entropy = stats.lse - stats.expected_score
  assert_close(np.where(valid, entropy, 0.0), ref_entropy, 1e-5, "entropy", atol=1e-5)
  rows = ce_math.backward_rows(
    g_loss,
    jnp.zeros_like(g_loss),
    stats.lse,
    labels,
    valid,
    options,
    vocab,
    g_entropy=g_ent,
    entropy=entropy,
  )
  dlogits = INTERPRET.backward(logits, labels, rows, options, jnp.bfloat16)
  assert_close(dlogits, ref_dlogits, 8e-3, "dlogits", atol=1e-6)


@pytest.mark.parametrize(
  "options", [PLAIN, ALL_OPTIONS, SCALED], ids=["plain", "all", "scaled"]
)
@pytest.mark.parametrize(
  ("logits_dtype", "out_dtype"),
  [
    (jnp.float32, jnp.float32),
    (jnp.float32, jnp.bfloat16),
    (jnp.float32, jnp.float16),
    (jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.float16),
    (jnp.float16, jnp.bfloat16),
  ],
  ids=["f32-f32", "f32-bf16", "f32-f16", "bf16-f32", "bf16-f16", "f16-bf16"],
)
def test_logits_and_dlogits_dtypes(rng, options, logits_dtype, out_dtype):
  """float32 logits (float16 inputs' default, ``logits_dtype=jnp.float32``)
  and ``dlogits`` of another dtype than the logits' (float32 inputs with
  16-bit logits): in place over equal dtypes, else into a new array. 1216
  columns are whole TMA tiles in every dtype, so no case leaves the kernels."""
  logits, labels, valid = _logits_case(rng, "normal", 200, 1216)
  logits = logits.astype(logits_dtype)  # the oracle reads these
  assert takes(logits)
  assert takes(jax.ShapeDtypeStruct(logits.shape, out_dtype))
  check_backend(INTERPRET, logits, labels, valid, options, rng, out_dtype)


def check_group_buffer(backend, rng, options, out_dtype, n_rows, vocab):
  """``dlogits`` of float32 logits written into rows ``n_rows:2 n_rows`` of
  a group's buffer of ``2.5 n_rows``, at a row given as a traced int32 (as
  the fused sweep's chunks give it), compiled, against the oracle; the
  buffer's other rows keep their values."""
  logits, labels, valid = _logits_case(rng, "normal", n_rows, vocab)
  g_loss = jnp.asarray(rng.random(n_rows) + 0.5, jnp.float32)
  buffer = jnp.asarray(rng.standard_normal((n_rows * 5 // 2, vocab)), out_dtype)
  assert backend._writes_into(logits, out_dtype, (buffer, jnp.int32(n_rows)))

  def run(logits, labels, valid, g_loss, buffer, row):
    into = (buffer, row)
    return backend.forward_backward(
      logits, labels, valid, g_loss, options, out_dtype, into=into
    )

  stats, got = jax.jit(run)(logits, labels, valid, g_loss, buffer, n_rows)
  (_, ref_lse, _), ref_dlogits = _oracle(
    logits, labels, valid, g_loss, jnp.zeros_like(g_loss), options
  )
  assert got.shape == buffer.shape and got.dtype == buffer.dtype
  np.testing.assert_array_equal(got[:n_rows], buffer[:n_rows])
  np.testing.assert_array_equal(got[2 * n_rows :], buffer[2 * n_rows :])
  rtol = 1e-5 if out_dtype == jnp.float32 else 8e-3
  assert_close(got[n_rows : 2 * n_rows], ref_dlogits, rtol, "dlogits")
  _, lse, _, _ = ce_math.row_outputs(stats, labels, valid, options, vocab)
  assert_close(lse, ref_lse, 1e-6, "lse")


@pytest.mark.parametrize(
  "options", [PLAIN, ALL_OPTIONS, SCALED], ids=["plain", "all", "scaled"]
)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_a_groups_buffer_is_written_in_place(rng, options, out_dtype):
  """The fused sweep's ``dlogits`` into a group's buffer (1216 columns:
  whole TMA tiles in either dtype)."""
  check_group_buffer(INTERPRET, rng, options, out_dtype, 128, 1216)


def test_a_groups_buffer_at_rows_not_whole_row_blocks_goes_to_the_fallback(rng):
  """Logits not whole row blocks, or a row (known when tracing) inside a row
  block: the fallback's results exactly."""
  logits, labels, valid = _logits_case(rng, "normal", 64, 640)
  g_loss = jnp.asarray(rng.random(64), jnp.float32)
  buffer = jnp.asarray(rng.standard_normal((256, 640)), jnp.bfloat16)
  args = (logits, labels, valid, g_loss)
  xla = backends.XlaChunkCE()
  for into, rows in [((buffer, 128), 56), ((buffer, 96), 64)]:
    sliced = [a[:rows] for a in args]
    assert not INTERPRET._writes_into(sliced[0], jnp.bfloat16, into)
    got = INTERPRET.forward_backward(*sliced, ALL_OPTIONS, jnp.bfloat16, into=into)
    want = xla.forward_backward(*sliced, ALL_OPTIONS, jnp.bfloat16, into=into)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "shape, dtype",
  [((37, 1031), jnp.bfloat16), ((200, 1000), jnp.bfloat16), ((64, 1000), jnp.float32)],
  ids=["ragged", "50257-like", "float32-ragged"],
)
def test_what_the_kernels_do_not_take_goes_to_the_fallback(rng, shape, dtype):
  """Rows not a multiple of 8, columns not of 64 (of 32 in float32): the
  fallback's results exactly."""
  logits, labels, valid = _logits_case(rng, "normal", *shape)
  logits = logits.astype(dtype)
  assert not takes(logits)
  g_loss = jnp.asarray(rng.random(shape[0]), jnp.float32)
  xla = backends.XlaChunkCE()
  for got, want in [
    (
      INTERPRET.forward(logits, labels, ALL_OPTIONS),
      xla.forward(logits, labels, ALL_OPTIONS),
    ),
    (
      INTERPRET.forward_backward(logits, labels, valid, g_loss, ALL_OPTIONS, dtype),
      xla.forward_backward(logits, labels, valid, g_loss, ALL_OPTIONS, dtype),
    ),
  ]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)
  check_backend(INTERPRET, logits, labels, valid, ALL_OPTIONS, rng, dtype)


def test_tiles_are_validated():
  with pytest.raises(ValueError, match="block_rows must be a multiple of 64"):
    MosaicBlocks(block_rows=32)
  with pytest.raises(ValueError, match="block_v must be a multiple of 64"):
    MosaicBlocks(block_v=100)
  with pytest.raises(ValueError, match="stages must be >= 1"):
    MosaicBlocks(stages=0)


def test_selection_on_hopper(monkeypatch):
  """impl=None and "mosaic": the Mosaic kernels with XLA's behind them;
  "pallas" and "xla" as asked, and a CPU: XLA."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: None)
  monkeypatch.setattr(backends, "pallas_unavailable_reason", lambda platform: None)
  for impl in (None, "mosaic"):
    chosen = backends.select(impl, "gpu")
    assert isinstance(chosen, MosaicChunkCE) and not chosen.interpret
    assert isinstance(chosen.fallback(), backends.XlaChunkCE)
    assert backends.select_gemm(impl, "gpu") == "mosaic"
  assert isinstance(backends.select("pallas", "gpu"), triton_ce.PallasTritonChunkCE)
  assert backends.select_gemm("pallas", "gpu") == "xla"
  backends._warn_fallback.cache_clear()
  with pytest.warns(RuntimeWarning, match="XLA's GEMMs instead of Mosaic"):
    assert isinstance(backends.select("mosaic", "cpu"), backends.XlaChunkCE)
  # Class weights with smoothing: the Mosaic kernels, with XLA's chunk behind.
  chosen = backends.select(None, "gpu", not_on_triton="w")
  assert isinstance(chosen, MosaicChunkCE)
  assert isinstance(chosen._fallback(jnp.ones(3)), backends.XlaChunkCE)
  with pytest.raises(NotImplementedError, match="does not compute w"):
    backends.select("pallas", "gpu", not_on_triton="w")

  reason = "no Triton lowering in this jax"
  monkeypatch.setattr(backends, "pallas_unavailable_reason", lambda platform: reason)
  backends._warn_fallback.cache_clear()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      for impl in (None, "mosaic"):
        chosen = backends.select(impl, "gpu")
        assert isinstance(chosen, MosaicChunkCE)
        assert isinstance(chosen.fallback(), backends.XlaChunkCE)
      assert isinstance(backends.select("xla", "gpu"), backends.XlaChunkCE)
  finally:
    backends._warn_fallback.cache_clear()


def test_impl_none_off_hopper_keeps_quiet(monkeypatch):
  """impl=None on another GPU: XLA's GEMMs and no warning; "mosaic" warns."""
  monkeypatch.setattr(mosaic_gemm, "unavailable_reason", lambda: "compute 8.0")
  monkeypatch.setattr(backends, "pallas_unavailable_reason", lambda platform: None)
  backends._warn_fallback.cache_clear()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert backends.select_gemm(None, "gpu") == "xla"
      chosen = backends.select(None, "gpu")
      assert isinstance(chosen, triton_ce.PallasTritonChunkCE)
    with pytest.warns(RuntimeWarning, match="XLA's GEMMs instead of Mosaic"):
      assert backends.select_gemm("mosaic", "gpu") == "xla"
  finally:
    backends._warn_fallback.cache_clear()


# ---- On a Hopper GPU: the compiled kernels at real sizes. ----


def _skip_without_hopper():
  assert has_gpu()
  if (reason := mosaic_gemm.unavailable_reason()) is not None:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "n_rows, vocab", [(1000, 32000), (1024, 128256), (2048, 256000)]
)
@pytest.mark.parametrize("options", [PLAIN, ALL_OPTIONS], ids=["plain", "all"])
def test_gpu_kernels_match_the_oracle(rng, n_rows, vocab, options):
  _skip_without_hopper()
  logits, labels, valid = _bf16_case(rng, "normal", n_rows, vocab)
  check_backend(MosaicChunkCE(), logits, labels, valid, options, rng, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["label_in_tail", "very_negative", "large"])
def test_gpu_edge_cases(rng, case):
  _skip_without_hopper()
  logits, labels, valid = _bf16_case(rng, case, 520, 32000)
  check_backend(MosaicChunkCE(), logits, labels, valid, SCALED, rng, jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_float16_and_few_rows(rng):
  """float16 logits; 8 rows (one ragged row block, many vocabulary parts)."""
  _skip_without_hopper()
  for n_rows, dtype in [(256, jnp.float16), (8, jnp.bfloat16)]:
    logits, labels, valid = _logits_case(rng, "normal", n_rows, 128256)
    logits = logits.astype(dtype)
    check_backend(MosaicChunkCE(), logits, labels, valid, ALL_OPTIONS, rng, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
  "vocab, out_dtype",
  [
    (128256, jnp.float32),
    (128256, jnp.bfloat16),
    (128256, jnp.float16),
    (32032, jnp.float32),
  ],
  ids=str,
)
def test_gpu_float32_logits(rng, vocab, out_dtype):
  """float32 logits: float32 tiles of 32 columns (32032 = 1001 of them),
  16-bit ``dlogits`` into a new array."""
  _skip_without_hopper()
  logits, labels, valid = _logits_case(rng, "normal", 1000, vocab)
  check_backend(MosaicChunkCE(), logits, labels, valid, ALL_OPTIONS, rng, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_a_groups_buffer_is_written_in_place(rng, out_dtype):
  """At the Llama-3 vocabulary: TMA writes the chunk's rows of the buffer,
  at a row read from device memory."""
  _skip_without_hopper()
  check_group_buffer(MosaicChunkCE(), rng, ALL_OPTIONS, out_dtype, 1024, 128256)


@pytest.mark.gpu
def test_gpu_softcap_scores_to_an_ulp(rng):
  """With a softcap the kernels run exact math: approximate ``tanh`` put 4e-5
  of error on target scores near 7 (float32 ulp 5e-7); XLA's are within 1e-6."""
  _skip_without_hopper()
  logits, labels, _ = _logits_case(rng, "normal", 64, 128256)
  logits = logits.astype(jnp.bfloat16)
  options = ce_math.CEOptions(logit_softcap=30.0)
  stats = jax.jit(lambda x: MosaicChunkCE().forward(x, labels, options))(logits)
  scores = 30.0 * np.tanh(np.asarray(logits, np.float64) / 30.0)
  row_max = scores.max(axis=1)
  lse = row_max + np.log(np.exp(scores - row_max[:, None]).sum(axis=1))
  target = scores[np.arange(64), np.asarray(labels)]
  np.testing.assert_allclose(np.asarray(stats.target), target, rtol=0, atol=4e-6)
  np.testing.assert_allclose(np.asarray(stats.lse), lse, rtol=0, atol=2e-6)


# Logits padded past a ragged vocabulary (``_gemm.matmul.mosaic_logits``: 1001
# columns padded to 1024). The padding holds values far above the rest, so a
# statistic that read it would be far off.
def _padded_case(rng, options_case="normal"):
  logits, labels, valid = _bf16_case(rng, options_case, 200, 1001)
  pad = jnp.full((200, 23), 60.0, jnp.bfloat16)
  return jnp.concatenate([logits, pad], axis=1), logits, labels, valid


@pytest.mark.parametrize(
  "options", [PLAIN, ALL_OPTIONS, SCALED], ids=["plain", "all", "scaled"]
)
def test_padded_logits_leave_the_padding_out(rng, options):
  """``chunk_forward`` of padded logits gives the statistics of the weight's
  columns; ``dlogits`` over them match those of the unpadded logits."""
  padded, logits, labels, valid = _padded_case(rng)
  d = 64
  x = backends.ChunkInputs(
    hidden=jnp.zeros((200, d), jnp.bfloat16),
    weight=jnp.zeros((1001, d), jnp.bfloat16),
    bias=None,
    labels=labels,
  )
  head = backends.HeadSpec("vd", jnp.dtype(jnp.bfloat16), options, 1001, gemm="mosaic")
  stats = INTERPRET.chunk_forward(x, head, logits=padded)
  want = INTERPRET.forward(logits, labels, options)
  for name in ("lse", "target", "mean_logit"):
    got, ref = getattr(stats, name), getattr(want, name)
    assert_close(got, np.asarray(ref, np.float64), 1e-6, name)
  np.testing.assert_array_equal(stats.argmax, want.argmax)
  check_backend(INTERPRET, logits, labels, valid, options, rng, jnp.bfloat16)
  rows = ce_math.backward_rows(
    jnp.ones((200,), jnp.float32),
    jnp.zeros((200,), jnp.float32),
    stats.lse,
    labels,
    valid,
    options,
    1001,
  )
  got = INTERPRET.chunk_backward(x, rows, head, jnp.bfloat16, logits=padded)
  ref = INTERPRET.backward(logits, labels, rows, options, jnp.bfloat16, 1001)
  assert got.shape == padded.shape
  # bfloat16 dlogits, whose exp XLA:CPU may vectorize differently per width.
  assert_close(got[:, :1001], np.asarray(ref, np.float64), 8e-3, "dlogits")
  assert not np.asarray(got[:, 1001:], np.float32).any()  # zeros, however large
  # The fallback's (float32 dlogits) are zero past the weight's columns too.
  scoring = INTERPRET._scoring(x, head)
  assert scoring.weight_columns == 1001
  got = scoring.backward(padded, labels, rows, options, jnp.float32, 1001)
  assert got.shape == padded.shape and not np.asarray(got[:, 1001:]).any()


SMOOTHED = ce_math.CEOptions(label_smoothing=0.2)


@pytest.mark.parametrize(
  "options", [SMOOTHED, ALL_OPTIONS, SCALED], ids=["smoothed", "all", "scaled"]
)
@pytest.mark.parametrize("padded", [False, True], ids=["whole", "padded"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_class_weights_with_smoothing(rng, options, padded, out_dtype):
  """Class weights with label smoothing: both kernels walk the weights'
  columns beside the logits' tiles (the statistics' weighted sum of scores,
  each column's weight in ``dlogits``), against the float64 oracle; padded
  logits (their padding far above the rest) leave the padding out. The
  weights follow the logits' columns: an unweighted mean of scores, or a
  ``dlogits`` of the wrong column's weight, is far off."""
  if padded:
    logits, _, labels, valid = _padded_case(rng)
    vocab, backend = 1001, dataclasses.replace(INTERPRET, weight_columns=1001)
  else:
    logits, labels, valid = _bf16_case(rng, "normal", 200, 1216)
    vocab, backend = 1216, INTERPRET
  assert takes(logits)
  column_mean = np.asarray(logits[:, :vocab], np.float32).mean(axis=0)
  weights = np.where(column_mean > np.median(column_mean), 1.9, 0.2) * rng.random(vocab)
  weights[rng.integers(0, vocab, vocab // 20)] = 0.0
  w = jnp.asarray(weights, jnp.float32)
  safe = jnp.clip(labels, 0, vocab - 1)
  classes = ce_math.ClassRows(
    jnp.where(valid, w[safe], 0.0), jnp.full((200,), jnp.sum(w) / vocab)
  )
  g_loss = jnp.asarray(rng.standard_normal(200), jnp.float32)
  with jax.enable_x64(True):
    x64 = jnp.asarray(np.asarray(logits[:, :vocab], np.float64))
    w64 = jnp.asarray(weights)

    def losses(x):
      loss = reference.losses_from_logits(
        x, labels, valid, options=options, class_weights=w64
      )[0]
      return jnp.where(valid, loss, 0.0)

    ref_loss = losses(x64)
    ref_dlogits = jax.grad(lambda x: jnp.sum(losses(x) * g_loss))(x64)
  stats = backend.forward(logits, labels, options, class_weights=w)
  loss = ce_math.row_outputs(stats, labels, valid, options, vocab, classes)[0]
  assert_close(loss, ref_loss, 1e-5, "loss", atol=1e-6)
  no_lse_cotangent = jnp.zeros_like(g_loss)
  rows = ce_math.backward_rows(
    g_loss, no_lse_cotangent, stats.lse, labels, valid, options, vocab, classes=classes
  )
  assert rows.target_weight is not None  # the kernel reads the columns' weights
  dlogits = backend.backward(logits, labels, rows, options, out_dtype, vocab, w)
  assert dlogits.shape == logits.shape and dlogits.dtype == out_dtype
  tolerance = 1e-5 if out_dtype == jnp.float32 else 8e-3
  assert_close(dlogits[:, :vocab], ref_dlogits, tolerance, "dlogits", atol=1e-7)
  assert not np.asarray(dlogits[:, vocab:], np.float32).any()


@pytest.mark.parametrize("n_rows", [128, 56, 37], ids=["whole", "blocks", "ragged"])
def test_padded_float32_logits_into_a_groups_buffer(rng, n_rows):
  """float32 logits padded past 1001 columns (the padding far above the
  rest) in one sweep into rows ``n_rows:2 n_rows`` of a group's padded
  16-bit buffer: by the kernel in place (whole row blocks), into a new
  array then copied (rows not whole blocks), or by the fallback (rows not
  whole TMA tiles). The statistics and ``dlogits`` of the weight's columns
  (label smoothing spread over 1001), zeros in the padding, the buffer's
  other rows unchanged."""
  logits, labels, valid = _logits_case(rng, "normal", n_rows, 1001)
  padded = jnp.concatenate([logits, jnp.full((n_rows, 23), 60.0)], axis=1)
  scoring = dataclasses.replace(INTERPRET, weight_columns=1001)
  g_loss = jnp.asarray(rng.random(n_rows) + 0.5, jnp.float32)
  buffer = jnp.asarray(rng.standard_normal((3 * n_rows, 1024)), jnp.bfloat16)

  def run(padded, labels, valid, g_loss, buffer, row):
    return scoring.forward_backward(
      padded, labels, valid, g_loss, ALL_OPTIONS, jnp.bfloat16, into=(buffer, row)
    )

  stats, got = jax.jit(run)(padded, labels, valid, g_loss, buffer, n_rows)
  (_, ref_lse, _), ref_dlogits = _oracle(
    logits, labels, valid, g_loss, jnp.zeros_like(g_loss), ALL_OPTIONS
  )
  assert got.shape == buffer.shape and got.dtype == buffer.dtype
  for rows in (slice(0, n_rows), slice(2 * n_rows, None)):
    np.testing.assert_array_equal(got[rows], buffer[rows])
  written = got[n_rows : 2 * n_rows]
  assert_close(written[:, :1001], ref_dlogits, 8e-3, "dlogits")
  assert not np.asarray(written[:, 1001:], np.float32).any()
  _, lse, _, _ = ce_math.row_outputs(stats, labels, valid, ALL_OPTIONS, 1001)
  assert_close(lse, ref_lse, 1e-6, "lse")


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("tile", [None, 96])
def test_padded_dlogits_products_read_the_weights_columns(rng, layout, tile):
  """``dhidden`` and ``dweight`` of ``dlogits`` padded past the weight's 1001
  columns (with values that would show) equal those of the first 1001, on
  XLA's GEMMs (what runs them where the Mosaic GEMM does not)."""
  rows, d, v, vp = 40, 64, 1001, 1024
  hidden = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
  weight = rng.standard_normal((v, d))
  weight = jnp.asarray(weight if layout == "vd" else weight.T, jnp.float32)
  dlogits = rng.standard_normal((rows, v))
  padded = np.concatenate([dlogits, np.full((rows, vp - v), 1e3)], axis=1)
  padded = jnp.asarray(padded, jnp.float32)
  w64 = np.asarray(weight, np.float64)
  w64 = w64 if layout == "vd" else w64.T  # [V, D]
  ref_dh = dlogits @ w64
  ref_dw = dlogits.T @ np.asarray(hidden, np.float64)  # [V, D]
  ref_dw = ref_dw if layout == "vd" else ref_dw.T
  dh = matmul.dhidden_matmul(padded, weight, layout, jnp.float32, tile=tile)
  assert_close(dh, ref_dh, 1e-5, "dhidden")
  start = jnp.asarray(rng.standard_normal(weight.shape), jnp.float32)
  dw = matmul.dweight_matmul(padded, hidden, layout, jnp.float32, into=start, tile=tile)
  assert_close(dw, ref_dw + np.asarray(start, np.float64), 1e-5, "dweight +=")
  if tile is None:  # a block's own dweight (vocabulary blocks)
    dw = matmul.dweight_matmul(padded, hidden, layout, jnp.float32, width=v)
    assert_close(dw, ref_dw, 1e-5, "dweight")
